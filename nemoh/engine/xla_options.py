"""XLA options compiled into the engine's programs (decode and prefill): per program, so XLA_FLAGS
(process-wide) stay as the user set them; within the programs these fields take precedence.

Both programs run their kernels as CUDA graphs (XLA command buffers). CONCURRENT scheduling records
each graph as a DAG of its kernels' buffer dependencies instead of one serial chain, so independent
kernels overlap: at batch 1 most kernels are tiny (routing, activation preparation, split-K sums) and
a MoE layer's routing runs beside its shared expert. On the H200 at Nano dims (NVFP4, gated) decode
went from 3.56 to 2.86 ms a step at batch 1 and from 11.05 to 10.27 ms at batch 32.

XLA's Triton GEMM fusions are off, so the dots XLA keeps (the router, prefill projections beyond the
kernels' row bound) go to cuBLAS with no Triton configs to autotune. On the H200 (NVFP4, one 2,048-token
prompt) prefill compiled in 32.0 s against 52.2 s and ran 11,710 against 9,814 tok/s; on an H100 the
batch-32 decode step took 9.90 against 10.05 ms (batch 1 unchanged). Figures: docs/BENCHMARKS.md.
Other backends ignore these options.
"""

ENGINE = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_gpu_enable_triton_gemm": False}
