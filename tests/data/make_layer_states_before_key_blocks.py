# Made with the code before the key blocks (main at 434722a), from the repository root:
#     PYTHONPATH=$PWD python tests/data/make_layer_states_before_key_blocks.py
# (writes /tmp/lc/fx/layer_states_before_key_blocks.pt; copied to tests/data).
# Run with main's code: the layer states of caches as they were before the key blocks.
import torch

from backends.contract import CacheSpec
from backends.policy import EvictionPolicy
from backends.registry import get_backend

g = torch.Generator().manual_seed(24)
out = {}
for name, backend, dtype in (
    ("cpu-float32", "cpu", torch.float32),
    ("cpu-bfloat16", "cpu", torch.bfloat16),
    ("cpu-float16", "cpu", torch.float16),
    ("int8-float32", "int8", torch.float32),
):
    spec = CacheSpec(1, 4, 2, 16, dtype, EvictionPolicy.sink(97, 3))  # a ring of 100: a last block of 36 rows
    cache = get_backend(backend).create_cache(spec)
    cache.prefill(torch.randn(1, 2, 130, 16, generator=g).to(dtype), torch.randn(1, 2, 130, 16, generator=g).to(dtype))
    for _ in range(25):  # past calibration, the ring turned
        cache.step(
            torch.randn(1, 4, 16, generator=g).to(dtype),
            torch.randn(1, 2, 16, generator=g).to(dtype),
            torch.randn(1, 2, 16, generator=g).to(dtype),
        )
    q, k, v = (
        torch.randn(1, 4, 16, generator=g).to(dtype),
        torch.randn(1, 2, 16, generator=g).to(dtype),
        torch.randn(1, 2, 16, generator=g).to(dtype),
    )
    out[name] = dict(
        tokens_seen=cache.tokens_seen,
        state=cache.export_state(),
        export=cache.export(),
        step=(q, k, v),
        output=cache.step(q, k, v).output,
    )
torch.save(out, "/tmp/lc/fx/layer_states_before_key_blocks.pt")
print({k: v["tokens_seen"] for k, v in out.items()})
