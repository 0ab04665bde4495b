"""Generates with a small random-weight transformers model whose attention runs on gqa-serve.

    make run                                   # a server at 127.0.0.1:50051, in another shell
    .venv/bin/python examples/generate.py      # --address, --model llama|mistral|qwen2, --tokens

The model (4 layers, 8 query / 2 KV heads of width 64) is made from a config with random
weights: nothing is downloaded. A batch of two left-padded prompts is generated greedily twice,
locally and with ``offload_attention``; the tokens are the same, and the handle's statistics
show what the service did. docs/integrations.md explains the mapping.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from gqa_client.transformers import offload_attention

SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    pad_token_id=0,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "mistral": lambda: transformers.MistralConfig(sliding_window=16, **SHAPE),  # a window shorter than the output
    "qwen2": lambda: transformers.Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=2, **SHAPE),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--model", choices=sorted(CONFIGS), default="qwen2")
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[args.model]()).eval()
    ids = torch.randint(1, SHAPE["vocab_size"], (2, 12))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # the second prompt is 7 tokens, left-padded
    options = dict(attention_mask=mask, max_new_tokens=args.tokens, do_sample=False)

    with torch.no_grad():
        local = model.generate(ids, **options)
        with offload_attention(model, args.address) as served:
            remote = model.generate(ids, **options)
            stats = served.stats
            layers = [(p.layer, p.policy, p.window) for p in served.plans]

    print(f"{args.model}: layers (index, policy, W) {layers}")
    print("served tokens:", remote[:, ids.shape[1] :].tolist())
    print("same as local:", torch.equal(remote, local))
    per_message = stats.round_trip_ns / max(1, stats.messages) / 1e3
    server = stats.server_ns / max(1, stats.messages) / 1e3
    print(
        f"{stats.messages} step messages ({stats.tokens} tokens x {len(layers)} layers), "
        f"round trip {per_message:.0f} us per message of which the server computed {server:.0f} us; "
        f"{stats.uploaded_bytes} bytes of prompt uploaded"
    )


if __name__ == "__main__":
    main()
