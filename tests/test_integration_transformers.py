"""flashgen as a transformers attention implementation, on tiny random-weight models.

Llama (causal, GQA, padding, KV-cache generation, training) against transformers' SDPA path;
Gemma 2 (sliding windows, softcapping: transformers' SDPA refuses softcap) and gpt-oss
(sliding windows, learnable sinks: no SDPA path either) against transformers' eager path.

The rule of TESTING.md: fp32 logits and gradients against the same model run in float64 by
transformers' own attention, relative error (flashgen.verify.compare); fp16 logits against
float32 with the fp16 SDPA model as the dtype's yardstick. A padded row is checked against its
sequence run alone (float64, unpadded): padding must not leak, and padded query rows are not
compared (transformers' paths fill them with different junk).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashgen.integrations.transformers import DEFAULT_NAME, attention_forward, padding_mask, register  # noqa: E402
from flashgen.verify import compare  # noqa: E402

NAME = register()
VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def _model(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    elif kind == "gemma2":  # layer 0 slides over 5 keys; a small cap makes tanh bend the scores
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **TINY, sliding_window=5, attn_logit_softcapping=0.5, query_pre_attn_scalar=16))
    else:
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **{**TINY, "intermediate_size": 64}, sliding_window=5, num_local_experts=4, num_experts_per_tok=2))
        model.set_experts_implementation("eager")  # grouped_mm has no float64
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()  # sinks that matter (initialised at std 0.02)
    return model.eval()


REFERENCE = {"llama": "sdpa", "gemma2": "eager", "gpt_oss": "eager"}


def _logits(model, impl, dtype, ids, **kw):
    model.set_attn_implementation(impl)
    return model.to(dtype)(ids, **kw).logits


def _assert_close(out, ref, pt=None, name="logits"):
    result = compare(name, out, ref, pt)
    assert result.ok, str(result)


def _padded_batch(gen):
    """Token ids (3, 21) and a left-padding mask: rows of 21, 16 and 9 real tokens."""
    ids = torch.randint(0, VOCAB, (3, 21), generator=gen)
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[1, :5] = mask[2, :12] = 0
    return ids, mask


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.interpreter
def test_logits_match_transformers_dense_and_padded(kind):
    model, gen = _model(kind), torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 23), generator=gen)
    ref = _logits(model, REFERENCE[kind], torch.float64, ids)
    _assert_close(_logits(model, NAME, torch.float32, ids), ref)

    ids, mask = _padded_batch(gen)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() gives them
    out = _logits(model, NAME, torch.float32, ids, attention_mask=mask, position_ids=positions)
    for row in range(3):
        real = mask[row].bool()
        alone = _logits(model, REFERENCE[kind], torch.float64, ids[row:row + 1, real])[0]
        _assert_close(out[row, real], alone, name=f"logits of row {row}")


@pytest.mark.interpreter
def test_a_padded_batch_is_packed_once_per_forward(monkeypatch):
    # The mask hook packs the padding mask once; every layer unpads with it (2 layers: one packing, not one
    # per layer, each a nonzero and a max: two waits for the GPU). A mask without the hook's packing (one
    # the layers get copied) is packed by the layer, to the same output.
    from flashgen.integrations import transformers as integration

    model, gen = _model("llama"), torch.Generator().manual_seed(6)
    ids, mask = _padded_batch(gen)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    calls, pack = [], integration._packing
    monkeypatch.setattr(integration, "_packing", lambda keep: calls.append(1) or pack(keep))
    _logits(model, NAME, torch.float32, ids, attention_mask=mask, position_ids=positions)
    assert len(calls) == 1
    q, k, v = (torch.randn(3, h, 21, 16, generator=gen) for h in (4, 2, 2))
    hooked = integration.padding_mask(3, 21, 21, attention_mask=mask)
    assert hooked._flashgen_packing is not None and len(calls) == 2
    layer = torch.nn.Module()
    out = attention_forward(layer, q, k, v, hooked, is_causal=True)[0]
    assert len(calls) == 2  # the hook's packing
    plain = attention_forward(layer, q, k, v, mask.clone(), is_causal=True)[0]
    assert len(calls) == 3 and torch.equal(out, plain)


@pytest.mark.interpreter
def test_a_window_over_padding_between_tokens_counts_positions():
    # A row with padding between its tokens (a right-padded prompt, then generated ones): packed, its tokens were
    # closer in the pack than in positions, and the window (5) reached further back than transformers' (a review's
    # catch: 0.27 off on the real tokens; under torch.compile it was right). Real tokens against SDPA's (eager's
    # float64 rows of pads wholly masked by the window are NaN, and so is the next layer).
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=5)).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 3:9] = 0
    out = _logits(model, NAME, torch.float32, ids, attention_mask=mask, use_cache=False)
    ref = _logits(model, "sdpa", torch.float64, ids, attention_mask=mask, use_cache=False)
    real = mask.bool()
    _assert_close(out[real], ref[real])
    # and with a sink beside the window (gpt-oss: its sink keeps eager's rows of pads finite)
    model = _model("gpt_oss")
    out = _logits(model, NAME, torch.float32, ids, attention_mask=mask, use_cache=False)
    _assert_close(out[real], _logits(model, "eager", torch.float64, ids, attention_mask=mask, use_cache=False)[real])


@pytest.mark.interpreter
def test_llama_fp16_logits():
    model, gen = _model("llama"), torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
    ref = _logits(model, "sdpa", torch.float32, ids)
    pt = _logits(model, "sdpa", torch.float16, ids)
    _assert_close(_logits(model, NAME, torch.float16, ids), ref, pt)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.interpreter
def test_greedy_generation_matches(kind):
    # Gemma 2 and gpt-oss generate past their 5-key window, from a KV cache that keeps the last keys.
    _assert_same_tokens(kind, "cpu", new_tokens=6)


def _assert_same_tokens(kind, device, new_tokens, **kw):
    """Greedy generation from two rows (one left-padded) gives transformers' own path's tokens (kw: generate's,
    the reference's too)."""
    model, gen = _model(kind).to(device).float(), torch.Generator().manual_seed(3)
    ids, mask = (t.to(device) for t in _padded_batch(gen))
    ids, mask = ids[:2, 3:], mask[:2, 3:]
    tokens = {}
    for impl in (REFERENCE[kind], NAME):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0, **kw)[:, ids.shape[1]:]
    assert torch.equal(tokens[NAME], tokens[REFERENCE[kind]]), tokens


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.interpreter
def test_generation_steps_run_the_decode_kernel(kind, monkeypatch):
    # Unpadded generation with decode_calls on: every step after the prompt is one query per row over
    # the cache, run by flashgen's split-KV decode kernel (Gemma 2: past its 5-key window, with
    # softcapping); each step's logits against the reference model in float64. Off (the default):
    # the prefill kernel runs the same steps.
    from flashgen.integrations import transformers as integration
    from flashgen.runtime.decode import DecodeLauncher

    monkeypatch.setattr(integration, "decode_calls", True)
    queries, original, seen = [], DecodeLauncher.read, set()

    def read(self, q, *args, **kwargs):
        if id(self) not in seen:  # plans an earlier test left (launchers are cached per kernel) would hide ours
            seen.add(id(self))
            self.calls.clear()
            self.reads.clear()
        if kwargs.get("layout") == "bhsd":  # the layer's own call (a first call reads its bshd views once more)
            queries.append(q.shape[2])
        return original(self, q, *args, **kwargs)

    monkeypatch.setattr(DecodeLauncher, "read", read)
    # each step's cache is one key longer; the decode launcher keys its calls without the length,
    # so each layer variant's calls are checked and planned once, not once per step
    prepared, prepare = [], DecodeLauncher.prepare
    monkeypatch.setattr(DecodeLauncher, "prepare", lambda self, *a, **kw: prepared.append(id(self))
                        or prepare(self, *a, **kw))
    model, gen = _model(kind), torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    runs = {}
    for impl, dtype in ((REFERENCE[kind], torch.float64), (NAME, torch.float32)):
        model.set_attn_implementation(impl)
        runs[impl] = model.to(dtype).generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                              output_logits=True, return_dict_in_generate=True)
    assert queries == [1] * 7 * TINY["num_hidden_layers"]  # 7 steps after the prompt's, every layer
    assert prepared and len(prepared) == len(set(prepared)), prepared
    ours, ref = runs[NAME], runs[REFERENCE[kind]]
    assert torch.equal(ours.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        _assert_close(a, b, name=f"logits of step {step}")
    monkeypatch.setattr(integration, "decode_calls", False)  # the prefill kernel for the same steps
    queries.clear()
    model.set_attn_implementation(NAME)
    again = model.to(torch.float32).generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert not queries and torch.equal(again, ref.sequences)


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
@pytest.mark.interpreter
def test_training_gradients_match(kind):
    # gpt-oss: the gradient reaches its sinks through the prepended sink key.
    _assert_gradients_match(kind, "cpu", seed=4, seqlen=15)


def _assert_gradients_match(kind, device, seed, seqlen):
    """Every parameter's gradient of a training step, fp32 against the reference path in float64."""
    model, gen = _model(kind).to(device), torch.Generator().manual_seed(seed)
    model.train()
    ids = torch.randint(0, VOCAB, (2, seqlen), generator=gen).to(device)
    grads = {}
    for impl, dtype in ((REFERENCE[kind], torch.float64), (NAME, torch.float32)):
        model.set_attn_implementation(impl)
        model.to(dtype).zero_grad()
        model(ids, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads[NAME]) == set(grads[REFERENCE[kind]])
    assert kind != "gpt_oss" or any("sinks" in n for n in grads[NAME])
    for n, g in grads[NAME].items():
        _assert_close(g, grads[REFERENCE[kind]][n], name=f"d{n}")


@pytest.mark.interpreter
def test_a_dense_call_adds_no_transposes_to_the_graph():
    # transformers' (B, H, L, D) query, a view of its (B, L, H, D) projection, goes to flashgen as it is (keys
    # and values come from its KV cache, contiguous): the output's one transpose (to transformers' (B, L, H,
    # D)) over the attention node, whose inputs are the caller's own tensors; out is contiguous (the o_proj
    # reshape is a view: not a copy per layer) and dq keeps q's strides.
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(2, 11, h, 16, generator=gen, requires_grad=True) for h in (4, 2, 2)]
    q = base[0].mul(1.0).transpose(1, 2)  # a non-leaf view, as rope's output is
    k, v = (t.mul(1.0).transpose(1, 2).contiguous() for t in base[1:])  # as the cache's torch.cat gives them
    module = torch.nn.Module()
    out, _ = attention_forward(module, q, k, v, None, scaling=0.25, is_causal=True)
    assert out.shape == (2, 11, 4, 16) and out.is_contiguous()
    attention_node = out.grad_fn.next_functions[0][0]
    assert type(attention_node).__name__ == "AttentionFunctionBackward"
    assert [fn for fn, _ in attention_node.next_functions[:3]] == [t.grad_fn for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.detach().double() for t in (q, k, v)), is_causal=True,
                                                           scale=0.25, enable_gqa=True).transpose(1, 2)
    _assert_close(out, ref, name="out")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert grads[0].stride() == q.stride()


@pytest.mark.interpreter
def test_packed_sequences_by_position_ids():
    # Padding-free training: two sequences in one row, positions restarting, must not see each other.
    model, gen = _model("llama"), torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 20), generator=gen)
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    out = _logits(model, NAME, torch.float32, ids, position_ids=positions)
    _assert_close(out[0, :12], _logits(model, "sdpa", torch.float64, ids[:, :12])[0], name="first")
    _assert_close(out[0, 12:], _logits(model, "sdpa", torch.float64, ids[:, 12:])[0], name="second")
    # a row that begins with a document's tail (positions 5, 6, 7): documents start wherever a step is not +1, as
    # transformers splits them (split at the minimum, the offsets began at 3: an error naming cu_seqlens_q)
    positions = torch.tensor([[5, 6, 7, *range(9), *range(8)]])
    out = _logits(model, NAME, torch.float32, ids, position_ids=positions, use_cache=False)
    _assert_close(out, _logits(model, "sdpa", torch.float64, ids, position_ids=positions, use_cache=False))


@pytest.mark.interpreter
def test_output_attentions_warns_that_no_weights_come_back():
    from flashgen.integrations import transformers as integration

    model = _model("llama")
    integration._warned.clear()
    with pytest.warns(UserWarning, match="^output_attentions: flashgen's transformers attention returns no"):
        model.set_attn_implementation(NAME)
        out = model(torch.randint(0, VOCAB, (1, 6)), output_attentions=True)
    assert not out.attentions


@pytest.mark.interpreter
def test_a_4d_mask_runs_with_sdpa_semantics():
    model, gen = _model("llama"), torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (2, 13), generator=gen)
    mask = torch.ones(13, 13, dtype=torch.bool).tril() & (torch.rand(2, 1, 13, 13, generator=gen) > 0.3)
    mask |= torch.eye(13, dtype=torch.bool)  # every query sees itself
    ref = _logits(model, "sdpa", torch.float64, ids, attention_mask=mask)
    _assert_close(_logits(model, NAME, torch.float32, ids, attention_mask=mask), ref)


@pytest.mark.interpreter
def test_dropout_in_training():
    # Uniform attention (q = 0) over 48 keys of ones: each output is (kept keys) / (48 * (1 - p)).
    module = torch.nn.Module()
    q, v = torch.zeros(2, 4, 48, 16), torch.ones(2, 2, 48, 16)
    out, _ = attention_forward(module, q, torch.randn(2, 2, 48, 16), v, None, dropout=0.25, is_causal=False)
    kept = out[..., 0] * 48 * 0.75
    assert torch.allclose(kept, kept.round(), atol=1e-4) and kept.std() > 0
    assert abs(out.mean().item() - 1.0) < 0.05


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="name: transformers treats names containing 'flash'"):
        register("my_flash")
    with pytest.raises(ValueError, match="name: expected an identifier-like string"):
        register("")
    assert register() == DEFAULT_NAME


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.interpreter
def test_static_cache_generation_matches(kind):
    """cache_implementation="static": the keys are the cache's slots, those past the filled ones unfilled (zeros),
    which the mask hook marks; a left-padded row's generation gives transformers' own path's tokens on the same
    static cache (Gemma 2's and gpt-oss's sliding layers fill, then roll their 5 slots)."""
    _assert_same_tokens(kind, "cpu", new_tokens=8, cache_implementation="static")


@pytest.mark.interpreter
def test_static_cache_steps_run_the_decode_kernel(monkeypatch):
    # Unpadded rows over a static cache: each step after the prompt is one query per row over the filled slots,
    # the decode kernel's call (the same route as a dynamic cache's), logits against float64 SDPA's
    from flashgen.runtime.decode import DecodeLauncher

    keys, original = [], DecodeLauncher.read
    monkeypatch.setattr(DecodeLauncher, "read", lambda self, q, k, *a, **kw: (kw.get("layout") == "bhsd" and keys.append(
        k.shape[2])) or original(self, q, k, *a, **kw))  # (the layer's own call: a first call reads bshd views again)
    model, gen = _model("llama"), torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    runs = {}
    for impl, dtype in (("sdpa", torch.float64), (NAME, torch.float32)):
        model.set_attn_implementation(impl)
        runs[impl] = model.to(dtype).generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                              cache_implementation="static", output_logits=True,
                                              return_dict_in_generate=True)
    layers = TINY["num_hidden_layers"]
    assert keys == [n for n in range(10, 14) for _ in range(layers)]  # the filled slots, not the cache's 13
    assert torch.equal(runs[NAME].sequences, runs["sdpa"].sequences)
    for step, (a, b) in enumerate(zip(runs[NAME].logits, runs["sdpa"].logits)):
        _assert_close(a, b, name=f"logits of step {step}")


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.interpreter
def test_static_cache_steps_compile_fullgraph(kind):
    """Traced over a static cache, the mask is the cache's fixed (batch, slots) shape, unfilled slots masked: a
    compiled step of 6 new queries per row (left-padded rows; their causal bound is each row's last filled slot,
    not the last slot) against the uncompiled reference model's, and transformers' compiled generation (one graph
    for every step)."""
    model, gen = _model(kind), torch.Generator().manual_seed(3)
    ids, mask = _padded_batch(gen)  # (3, 21): 15 prompt tokens, then 6 at once
    logits = {}
    for impl, compiled in ((REFERENCE[kind], False), (NAME, True)):
        model.set_attn_implementation(impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        run = lambda ids, mask: model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits  # noqa: E731
        torch._dynamo.reset()
        with torch.no_grad():
            run(ids[:, :15], mask[:, :15])
            logits[impl] = (torch.compile(run, fullgraph=True, backend="aot_eager") if compiled else run)(ids[:, 15:], mask)
    real = mask[:, 15:].bool()
    _assert_close(logits[NAME][real], logits[REFERENCE[kind]][real])
    if kind == "llama":  # generate's steps compiled as transformers does on a GPU
        compile_config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        compile_config._compile_all_devices = True  # (transformers compiles generation steps on accelerators only)
        ids, mask = ids[:2, 3:], mask[:2, 3:]
        tokens = {}
        for impl, kw in (("sdpa", {}), (NAME, dict(compile_config=compile_config))):
            model.set_attn_implementation(impl)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                          cache_implementation="static", **kw)[:, ids.shape[1]:]
        assert torch.equal(tokens[NAME], tokens["sdpa"]), tokens
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the steps after the prompt's, one graph


@pytest.mark.parametrize("window, sinks", [(None, False), (4, False), (4, True)], ids=["causal", "window", "sinks"])
@pytest.mark.interpreter
def test_a_static_cache_mask_as_hooked_copied_and_traced(window, sinks):
    """One layer over a static cache of 16 slots, 9 filled, 3 new queries, row 1 left-padded: the hook's mask
    (eager), a copy of it (which loses what the hook's tensor carries: .to(another device) makes one) and the call
    traced (fullgraph; a window and sinks take their bounds from the filled count), against a float64 reference
    over the filled slots (a copy took the unfilled slots as tokens, 0.93 off)."""
    gen = torch.Generator().manual_seed(0)
    batch, slots, filled, new = 2, 16, 9, 3
    q = torch.randn(batch, 4, new, 16, generator=gen)
    k, v = torch.zeros(batch, 2, slots, 16), torch.zeros(batch, 2, slots, 16)
    k[:, :, :filled], v[:, :, :filled] = (torch.randn(batch, 2, filled, 16, generator=gen) for _ in range(2))
    padding = torch.ones(batch, filled, dtype=torch.bool)
    padding[1, :2] = False
    s_aux = torch.randn(4, generator=gen) if sinks else None
    hooked = padding_mask(batch, new, slots, q_offset=torch.tensor(filled - new), attention_mask=padding)
    run = lambda mask: attention_forward(torch.nn.Module(), q, k, v, mask, is_causal=True, sliding_window=window,  # noqa: E731
                                         s_aux=s_aux, scaling=0.25)[0]
    torch._dynamo.reset()
    outs = {"hooked": run(hooked), "copied": run(hooked.clone()),
            "traced": torch.compile(run, fullgraph=True, backend="aot_eager")(hooked)}
    pos = torch.arange(filled)
    rows = (filled - new + torch.arange(new))[:, None]
    seen = (pos <= rows) & ((pos > rows - window) if window else True) & padding[:, None, None, :]  # (B, 1, L, S)
    scores = torch.einsum("bhld,bhsd->bhls", q.double(), k[:, :, :filled].double().repeat_interleave(2, 1)) * 0.25
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks:
        scores = torch.cat([scores, s_aux.double()[None, :, None, None].expand(batch, -1, new, 1)], dim=-1)
    p = scores.softmax(-1)[..., :filled]
    ref = torch.einsum("bhls,bhsd->blhd", p, v[:, :, :filled].double().repeat_interleave(2, 1))
    for name, out in outs.items():
        _assert_close(out, ref, name=name)


@pytest.mark.interpreter
def test_static_cache_masks_read_as_transformers_reads_them():
    # Gemma 2's sliding layer (5 slots) before it fills, given a 2-d mask of the cache's 16 positions (as SDPA's
    # and eager paths take it): padding is read from the layer's first position, not the mask's last five (0.36 off)
    model, gen = _model("gemma2"), torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 3), generator=gen)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 0] = 0
    logits = {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    _assert_close(logits[NAME][:, 1:], logits["eager"][:, 1:])
    # without a cache a mask longer than the tokens is named (not read as a static cache's)
    model.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match=r"attention_mask: expected a \(batch, keys\) = \(2, 3\)"):
        model(ids, attention_mask=mask[:, :8], use_cache=False)


@pytest.mark.parametrize("kw, words", [
    (dict(sliding_window=0), "sliding_window: expected a positive int or None, got 0"),
    (dict(s_aux=torch.zeros(4, 1)), "s_aux: expected a (heads,) tensor of sink logits"),
    (dict(attention_mask=torch.ones(3, 7, dtype=torch.bool)), "attention_mask: expected a (batch, keys) = (2, 7)"),
    (dict(attention_mask=torch.ones(2, 1, 5, 7, dtype=torch.bool), softcap=5.0),
     "attention_mask: a 4-d mask cannot be combined with sliding_window, softcap or s_aux"),
    (dict(position_bias=torch.zeros(2, 4, 5, 7)), "position_bias: not supported"),
    (dict(dropout="x"), "dropout: expected a number, got 'x'"),
    (dict(dropout=True), "dropout: expected a number, got True"),
    (dict(cu_seq_lens_q=torch.tensor([0, 5]), cu_seq_lens_k=torch.tensor([0, 7]), max_length_q=2.7, max_length_k=7),
     "max_length_q: expected an integer, got 2.7"),
    # offsets in floats were truncated by .to(int32); one of the four alone was ignored (a dense call)
    (dict(cu_seq_lens_q=torch.tensor([0.0, 5.7]), cu_seq_lens_k=torch.tensor([0, 7]), max_length_q=5, max_length_k=7),
     "cu_seq_lens_q: expected an integer tensor of sequence offsets"),
    (dict(cu_seq_lens_q=torch.tensor([0, 5])),
     "cu_seq_lens_k, max_length_q, max_length_k: expected with cu_seq_lens_q"),
    (dict(softcap="x"), "softcap: expected a number"),
])
def test_bad_arguments_name_the_argument(kw, words):
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16)
    with pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
        attention_forward(torch.nn.Module(), q, k, k, kw.pop("attention_mask", None), **kw)
    assert words in str(info.value)


@pytest.mark.parametrize("src_lengths", [(14, 14, 14), (14, 9, 5)], ids=["unpadded", "padded"])
@pytest.mark.parametrize("tgt_len", [6, 14], ids=["shorter", "same-length"])
@pytest.mark.interpreter
def test_encoder_decoder_cross_attention_matches(src_lengths, tgt_len):
    """BART: the decoder's cross-attention over the encoder's tokens. Its queries took the encoder's padding
    (5 and 6 of 6 decoder rows of the padded rows came back zero, 1.9 off), and without an encoder mask the
    cross-attention's longer keys were refused as a static cache."""
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    model = transformers.BartForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, VOCAB, (3, 14), generator=gen)
    tgt = torch.randint(4, VOCAB, (3, tgt_len), generator=gen)
    kw = {}
    if min(src_lengths) < 14:
        kw["attention_mask"] = (torch.arange(14)[None] < torch.tensor(src_lengths)[:, None]).long()
    outs = {}
    for impl, dtype in (("eager", torch.float64), (NAME, torch.float32)):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.to(dtype)(input_ids=src, decoder_input_ids=tgt, use_cache=False, **kw).logits
    _assert_close(outs[NAME], outs["eager"])


@pytest.mark.parametrize("kind,case", [("llama", "padded"), ("llama", "batch-1"), ("llama", "packed"),
                                       ("llama", "dynamic"), ("gemma2", "padded")])
@pytest.mark.interpreter
def test_the_model_compiles_fullgraph(kind, case):
    """torch.compile(fullgraph=True) of the whole model: a padded batch and batch 1 (whose position_ids the
    model always passes) broke the graph on values read (the mask's all(), nonzero, the positions' test);
    traced, the padding and packed positions are dense masks over named tensors, as SDPA's mask."""
    model, gen = _model(kind), torch.Generator().manual_seed(7)
    kw = {}
    if case in ("padded", "dynamic"):  # dynamic: dynamic=True, whose symbolic self.scaling tracing refused
        ids, mask = _padded_batch(gen)
        if case == "padded":
            kw["attention_mask"] = mask
    else:
        ids = torch.randint(0, VOCAB, (1, 20), generator=gen)
        if case == "packed":
            kw["position_ids"] = torch.cat([torch.arange(12), torch.arange(8)])[None]
    model.set_attn_implementation(NAME)
    model.float()
    run = lambda ids, **kw: model(ids, use_cache=False, **kw).logits  # noqa: E731
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(run, fullgraph=True, backend="aot_eager", dynamic=case == "dynamic" or None)(ids, **kw)
        eager = run(ids, **kw)
    real = kw["attention_mask"].bool() if case == "padded" else torch.ones(ids.shape, dtype=torch.bool)
    torch.testing.assert_close(out[real], eager[real], atol=2e-5, rtol=1e-4)  # padded rows: no one reads them


@pytest.mark.interpreter
def test_sinks_over_a_padded_batch_compile_fullgraph():
    # gpt-oss's layer (its MoE loop does not compile): sinks and a window over left padding, traced
    layer = torch.nn.Module()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, h, 21, 16, generator=gen) for h in (4, 2, 2))
    _, mask = _padded_batch(gen)
    sinks = torch.randn(4, generator=gen)
    run = lambda q, k, v, mask: attention_forward(layer, q, k, v, mask, scaling=0.25, sliding_window=5,  # noqa: E731
                                                  s_aux=sinks, is_causal=True)[0]
    torch._dynamo.reset()
    out = torch.compile(run, fullgraph=True, backend="aot_eager")(q, k, v, mask)
    real = mask.bool()
    torch.testing.assert_close(out[real], run(q, k, v, mask)[real], atol=2e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_gpu_bf16_logits_match_transformers(kind):
    # bf16 on the GPU by TESTING.md's rule: the reference is transformers' own path in float32 over the same
    # bf16 weights and tokens, its bf16 run the dtype's yardstick; dense and left-padded (real rows only).
    # Not gpt-oss: its router sends a token to other experts on rounding differences. Its bf16 logits here
    # were 0.0962 from the float32 path's (the eager bf16 path's 0.0033), and so, to the last digit, were
    # those of FlashAttention's numerics written in PyTorch over its eager layer (scores and the softmax
    # in float32, P rounded to bf16 before P V; 0.0038 with P in float32): the kernels do what that
    # algorithm does (benchmarks/NOTES.md, session 31). Its sinks run on the GPU in test_gpu_training_*.
    model, gen = _model(kind).cuda().to(torch.bfloat16), torch.Generator().manual_seed(8)
    dense = torch.randint(0, VOCAB, (2, 23), generator=gen).cuda()
    ids, mask = (t.cuda() for t in _padded_batch(gen))
    cases = ((dense, {}), (ids, {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}))
    runs = {}
    for impl, dtype in ((NAME, torch.bfloat16), (REFERENCE[kind], torch.bfloat16), (REFERENCE[kind], torch.float32)):
        with torch.no_grad():
            runs[impl, dtype] = [_logits(model, impl, dtype, tokens, **kw).float() for tokens, kw in cases]
    (out, out_padded), (pt, pt_padded), (ref, ref_padded) = runs.values()
    _assert_close(out, ref, pt, name="dense logits")
    real = mask.bool()
    _assert_close(out_padded[real], ref_padded[real], pt_padded[real], name="padded logits")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_gpu_training_gradients_match(kind):
    # On the GPU in fp32 (gpt-oss's sinks included): bf16 gradients of a whole model compound both paths'
    # roundings through every layer (the per-kernel rule is the kernels' own tests').
    _assert_gradients_match(kind, "cuda", seed=9, seqlen=31)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_gpu_greedy_generation_matches(kind):
    # fp32 on the GPU (Gemma 2 past its 5-key window): each step after the prompt runs the decode kernel.
    _assert_same_tokens(kind, "cuda", new_tokens=12)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_gpu_static_cache_generation_matches(kind):
    # a static cache on the GPU: transformers compiles the steps after the prompt (inductor, CUDA graphs), both
    # implementations, over the cache's fixed (batch, slots) mask
    torch._dynamo.reset()
    _assert_same_tokens(kind, "cuda", new_tokens=12, cache_implementation="static")
