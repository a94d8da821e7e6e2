"""Pure layer functions: params and inputs in, outputs (and carried state) out."""
