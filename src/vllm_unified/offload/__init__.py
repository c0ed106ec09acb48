"""KV offload to host RAM and disk for vLLM's OffloadingConnector.

vLLM keeps the scheduler side (which blocks to offload, where they live, eviction, secondary
tiers); this package supplies what vLLM 0.32 refuses on a platform that is not CUDA-alike:

* :mod:`.config`: the platform policy that turns ``--kv-offloading-size`` (and an explicit
  ``--kv-transfer-config``) into vLLM's OffloadingConnector with :class:`.spec.MLXOffloadingSpec`,
  and refuses what is not supported (no MLX import; runs in every process);
* :mod:`.spec`: the offloading spec (vLLM's tiering spec with our worker);
* :mod:`.worker` and :mod:`.transfer`: block copies between the KV pool and the host pool;
* :mod:`.host_views`: the zero-copy guard on every numpy view of shared bytes;
* :mod:`.disk`: the disk tier (vLLM's fs tier with private modes, checksums, layout keys);
* :mod:`.runner`: the few calls the model runner and worker make each step.
"""
