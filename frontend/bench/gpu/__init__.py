"""`pagedserve bench kernels`: GPU kernel timings against their bytes and FLOP floors (kernels.py). Only the
subcommand's module is imported to build the CLI; the timing code (torch on CUDA, triton) is imported when it runs,
on a machine with a GPU."""
