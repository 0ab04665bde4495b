"""transformers models with their attention on gqa-serve (gqa_client.transformers): greedy
generation equals the local eager model token for token, with the same scores, for Llama,
Mistral (a window shorter than the generation) and Qwen2 (full and sliding layers mixed);
bfloat16 and int8 sessions within their dtype's error; sink and greedy run past the window; a
failure mid-generation raises a clear error and leaves nothing open on the server.

Random-weight models from configs (no downloads), 2-3 layers of 4 query / 2 KV heads of 16."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from service.config import ServerConfig
from service.server import ServerThread
from tests.test_int8_backend import BUDGET as INT8_BUDGET

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

from gqa_client import transformers as served_hf  # noqa: E402 (after the importorskip)

WINDOW = 5
NEW_TOKENS = 12  # more than 2 windows
SHAPE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **SHAPE))


def mistral():
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SHAPE)
    )


def qwen2():
    # layer 0 full, layers 1 and 2 sliding: two sessions
    config = transformers.Qwen2Config(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **SHAPE
    )
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return transformers.Qwen2ForCausalLM(config)


MODELS = {"llama": llama, "mistral": mistral, "qwen2": qwen2}


def make(name: str, dtype=torch.float32, attn="eager"):
    torch.manual_seed(1234)
    model = MODELS[name]()
    # Larger weights than the default init, so that attention is far from uniform and the
    # tokens depend on it (with std 0.02 every score is nearly equal).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.set_attn_implementation(attn)
    return model.to(dtype).eval()


def prompts(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts: row i is ``length - 2*i`` tokens long (at least 2)."""
    g = torch.Generator().manual_seed(batch * 100 + length)
    ids = torch.randint(1, SHAPE["vocab_size"], (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):
        pad = min(2 * i, length - 2)
        ids[i, :pad] = 0
        mask[i, :pad] = 0
    return ids, mask


def generate(model, ids, mask, new=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )


@pytest.fixture(scope="module")
def server():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as thread:
        yield thread


def open_sequences(server) -> int:
    return server.engine.active_streams


# -- float32: token for token, scores within 1e-4 ---------------------------------------------
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("length", [3, 11], ids=["prompt<window", "prompt>window"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_equals_the_local_eager_model(server, name, length, batch):
    model = make(name)
    ids, mask = prompts(batch, length)
    local = generate(model, ids, mask)
    with served_hf.offload_attention(model, server.address) as served:
        remote = generate(model, ids, mask)
        assert served.stats.messages == len(model.model.layers) * (NEW_TOKENS - 1)
        assert len(served.groups) == (2 if name == "qwen2" else 1)
    assert model.config._attn_implementation == "eager"  # restored
    assert torch.equal(remote.sequences, local.sequences)
    for step, (a, b) in enumerate(zip(remote.scores, local.scores)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")
    assert open_sequences(server) == 0


def test_sliding_layers_are_strict_with_the_models_window_and_full_layers_keep_everything():
    model = make("qwen2")
    plans = served_hf.plans.plan_layers(model.config, None, None, 4, None)
    assert [(p.policy, p.window, p.group, p.index) for p in plans] == [
        ("none", 0, 0, 0),
        ("strict", WINDOW, 1, 0),
        ("strict", WINDOW, 1, 1),
    ]
    with pytest.raises(ValueError, match="needs window="):
        served_hf.plans.plan_layers(model.config, "sink", None, 4, None)
    sink = served_hf.plans.plan_layers(model.config, "sink", 8, 2, None)
    assert [(p.policy, p.window, p.sinks) for p in sink] == [("sink", 8, 2), ("sink", WINDOW, 2), ("sink", WINDOW, 2)]


# -- forward calls, bfloat16 and int8 ------------------------------------------------------------
def teacher_forced(model, ids, mask, tokens) -> tuple[torch.Tensor, object]:
    """The logits (steps, B, vocab) of the prompt's last position and of each of ``tokens``
    (B, steps) fed one forward call at a time, the cache passed along."""
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        logits = [out.logits[:, -1].float()]
        for t in range(tokens.shape[1] - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(tokens[:, t : t + 1], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits), out.past_key_values


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm((a - b).double()) / torch.linalg.norm(b.double()))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_bfloat16_sessions_are_as_close_as_the_local_bfloat16_model(server, name):
    ids, mask = prompts(2, 9)
    exact = make(name)
    tokens = generate(exact, ids, mask).sequences[:, ids.shape[1] :]
    reference, _ = teacher_forced(exact, ids, mask, tokens)
    local_bf16, _ = teacher_forced(make(name, torch.bfloat16), ids, mask, tokens)
    model = make(name, torch.bfloat16)
    with served_hf.offload_attention(model, server.address) as served:
        assert served.dtype == torch.bfloat16
        remote, cache = teacher_forced(model, ids, mask, tokens)
        assert isinstance(cache, served_hf.ServedCache) and open_sequences(server) == 2 * len(served.groups)
        cache.close()
    assert open_sequences(server) == 0
    local_error, served_error = _rel(local_bf16, reference), _rel(remote, reference)
    assert served_error <= 2 * local_error + 1e-3, (served_error, local_error)


def first_layer_attention(model, ids, mask, tokens) -> torch.Tensor:
    """Layer 0's attention outputs (after o_proj) at every decode step: the same inputs (the
    embeddings) reach it locally and served, so its error is the cache's alone."""
    outputs = []
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda module, args, output: outputs.append(output[0].float()) if output[0].shape[1] == 1 else None
    )
    try:
        teacher_forced(model, ids, mask, tokens)
    finally:
        hook.remove()
    return torch.stack(outputs)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_int8_caches_stay_within_the_int8_budget(server, name):
    ids, mask = prompts(2, 9)
    model = make(name)
    tokens = generate(model, ids, mask).sequences[:, ids.shape[1] :]
    reference = first_layer_attention(model, ids, mask, tokens)
    with served_hf.offload_attention(model, server.address, backend="int8") as served:
        remote = first_layer_attention(model, ids, mask, tokens)
        assert served.groups[0].session.opened.backend == "int8"
    assert open_sequences(server) == 0  # the forward calls' caches were collected and removed at close
    error = _rel(remote, reference)
    assert 0 < error <= INT8_BUDGET["normal"], error


def test_a_loaded_context_larger_than_a_message_continues_like_the_local_cache(server):
    """``ServedCache.load`` of 20000 positions (5 MB of keys and values: several 4 MiB ``add``
    chunks), then forward calls: the logits of the same model continuing a ``DynamicCache``."""
    model = make("llama", attn="sdpa")
    g = torch.Generator().manual_seed(5)
    shape = (1, SHAPE["num_key_value_heads"], 20000, SHAPE["head_dim"])
    layers = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(2)]
    local = transformers.DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        local.update(k, v, i)
    tokens = torch.tensor([[3, 17, 42]])
    with torch.no_grad():
        want = [model(tokens[:, i : i + 1], past_key_values=local, use_cache=True).logits for i in range(3)]
        with served_hf.offload_attention(model, server.address) as served:
            cache = served.new_cache(max_length=20010)
            cache.load(layers)
            assert served.stats.uploaded_bytes == 2 * 2 * 20000 * 2 * 16 * 4
            assert cache.get_seq_length() == 20000
            got = [model(tokens[:, i : i + 1], past_key_values=cache, use_cache=True).logits for i in range(3)]
            cache.close()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert open_sequences(server) == 0


def test_padding_after_the_prompt_is_refused(server):
    model = make("llama")
    ids, mask = prompts(2, 4)
    with served_hf.offload_attention(model, server.address), torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        holey = torch.cat([mask, torch.tensor([[1], [0]])], dim=1)
        with pytest.raises(NotImplementedError, match="only the prompt may be padded"):
            model(ids[:, :1], attention_mask=holey, past_key_values=out.past_key_values, use_cache=True)
        out.past_key_values.close()
    assert open_sequences(server) == 0


# -- other policies: past any window -----------------------------------------------------------
@pytest.mark.parametrize(
    "name, options",
    [
        ("mistral", dict(policy="greedy")),
        ("mistral", dict(policy="sink", sink_tokens=2)),
        ("llama", dict(policy="sink", window=WINDOW, sink_tokens=2)),
        ("qwen2", dict(policy="greedy", window=WINDOW, capacity=WINDOW + 2)),
    ],
    ids=["mistral-greedy", "mistral-sink", "llama-sink", "qwen2-greedy"],
)
def test_greedy_and_sink_run_to_three_windows(server, name, options):
    model = make(name)
    ids, mask = prompts(2, 3)
    new = 3 * WINDOW + 2
    with served_hf.offload_attention(model, server.address, **options) as served:
        out = generate(model, ids, mask, new=new)
        assert out.sequences.shape == (2, 3 + new)
        assert served.stats.messages == len(model.model.layers) * (new - 1)
        assert {p.policy for p in served.plans} == {options["policy"]}
    assert open_sequences(server) == 0


def test_greedy_attends_like_strict(server):
    """greedy keeps more rows than strict but attends to the same window: the same tokens."""
    model = make("mistral")
    ids, mask = prompts(2, 11)
    local = generate(model, ids, mask)
    with served_hf.offload_attention(model, server.address, policy="greedy", capacity=2 * WINDOW + 1):
        remote = generate(model, ids, mask)
    assert torch.equal(remote.sequences, local.sequences)


# -- failures ------------------------------------------------------------------------------------
class _Raise(transformers.StoppingCriteria):
    def __init__(self, at: int, action):
        self.at, self.action, self.calls = at, action, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.action()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_failure_inside_generate_removes_the_sequences(server):
    model = make("qwen2")
    ids, mask = prompts(4, 7)

    def fail():
        assert open_sequences(server) == 4 * 2  # 4 sequences in each of 2 sessions
        raise RuntimeError("the caller's own failure")

    with served_hf.offload_attention(model, server.address):
        with pytest.raises(RuntimeError, match="the caller's own failure"):
            model.generate(
                ids, attention_mask=mask, max_new_tokens=8, do_sample=False, stopping_criteria=[_Raise(3, fail)]
            )
        assert open_sequences(server) == 0
        assert generate(model, ids, mask, new=3).sequences.shape == (4, 10)  # the handle goes on
    assert open_sequences(server) == 0


def test_a_server_that_goes_away_mid_generation_raises_a_clear_error():
    srv = ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)).start()
    model = make("llama")
    ids, mask = prompts(2, 5)
    try:
        with served_hf.offload_attention(model, srv.address) as served:
            with pytest.raises(served_hf.ServedAttentionError) as failed:
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=10,
                    do_sample=False,
                    stopping_criteria=[_Raise(4, srv.stop)],
                )
            assert failed.value.code == "UNAVAILABLE"
            assert srv.address in str(failed.value) and "decode step" in str(failed.value)
            assert served.groups[0].session is None  # dropped; the next call opens a fresh one
        assert srv.engine.active_streams == 0 and srv.engine.batch_sequences_open == 0
    finally:
        srv.stop()


def test_a_full_cache_is_refused_with_the_reason(server):
    model = make("llama")
    ids, mask = prompts(1, 4)
    with served_hf.offload_attention(model, server.address, max_length=6) as served:
        with pytest.raises(served_hf.ServedAttentionError, match="max_length") as full:
            generate(model, ids, mask, new=6)
        assert full.value.code == "RESOURCE_EXHAUSTED"
        assert served.stats.messages > 0
    assert open_sequences(server) == 0


def test_what_the_service_does_not_compute_is_refused():
    config = transformers.Gemma2Config(num_hidden_layers=2, **SHAPE)  # soft-capping, another scale
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(NotImplementedError, match="soft-capping"):
        served_hf.offload_attention(model, "127.0.0.1:1")
    assert model.config._attn_implementation != served_hf.ATTN_IMPLEMENTATION


# -- the docs run as written ---------------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_integrations_page_runs_as_written(server, capsys):
    text = (ROOT / "docs" / "integrations.md").read_text()
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert '"127.0.0.1:50051"' in snippet
    exec(compile(snippet.replace('"127.0.0.1:50051"', repr(server.address)), "integrations.md", "exec"), {})
    out = capsys.readouterr().out
    assert "ServedStats(messages=" in out and "messages=124" in out  # 31 decode tokens x 4 layers
    assert open_sequences(server) == 0


def test_the_example_generates_the_local_tokens(server, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(
        sys, "argv", ["generate.py", "--address", server.address, "--model", "mistral", "--tokens", "20"]
    )
    runpy.run_path(str(ROOT / "examples" / "generate.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "same as local: True" in out and "76 step messages (19 tokens x 4 layers)" in out, out
