"""equations(): every equation a function traced to, those of the jaxprs nested in its equations'
parameters (loops, conditionals, jitted calls) included, for tests of what an op traces to."""

from __future__ import annotations

import jax.extend


def equations(jaxpr, opaque=frozenset()):
    """Each equation of `jaxpr`, then those of its nested jaxprs, depth first; equations whose primitive
    is named in `opaque` (a kernel call, whose body is the kernel's own) are yielded but not entered."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name not in opaque:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from equations(sub, opaque)
