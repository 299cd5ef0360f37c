"""The test and ops harness, shared by tests/ and scripts/: import it as `pagedserve.tests.helpers.<part>.<module>`.

- models/: tiny random-weight checkpoints (text, vision-language, pooling, GGUF, AWQ/GPTQ, LoRA adapters) and
  the hub-cache layout they can be laid out in;
- kernels/: kernel cases and their references (paged attention, int4/intN packs, whether the C step runs);
- processes/: what the tests start and talk to: `engine-serve` (server, server_pool), the router and its
  upstreams, a fake Kubernetes API server, a Ray cluster, gloo ranks, the /metrics reader and the soak mix;
- rl/: a trainer process, a worker extension and the weight-update cases of the RL tests;
- at the top: what one kind of test shares (HF parity, prompts, schemas, doc blocks, xdist order).
"""
