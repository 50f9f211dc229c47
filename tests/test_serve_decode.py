"""examples/serve_decode.py: greedy decoding of a random-init transformers Llama with flashgen's
prefill and decode over a KV cache (contiguous and paged) gives transformers' own tokens."""

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "serve_decode.py"


def _example():
    spec = importlib.util.spec_from_file_location("serve_decode", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_loop_matches_transformers_on_the_cpu(device):
    # fp32 through the interpreter: every token equal. Prompts of 5, 9 and 3 tokens (each its own
    # cache length), 6 new tokens; pages of 4 keys, so prompts and appends cross pages.
    if device != "cpu":
        pytest.skip("the CPU interpreter's size; the GPU runs test_serving_loop_matches_transformers_gpu")
    results = _example().run(tiny=True, new_tokens=6, page_sizes=(None, 4), lengths=(5, 9, 3))
    assert set(results) == {"contiguous", "paged-4"}
    for kind, (tokens, expected, _) in results.items():
        assert tokens.shape == (3, 6) and torch.equal(tokens.cpu(), expected.cpu()), kind


@pytest.mark.gpu
def test_serving_loop_matches_transformers_gpu():
    # fp32: every token equal. bf16: equal up to the first step (if any) where transformers' own
    # two best logits lie within bf16's noise of each other (0.1 apart), where either choice is
    # right and the sequences then differ for good; that step is a decode step (the prefill's
    # token, step 0, does not go through the decode kernel). On the H100 the paged-16 cache's
    # default (32-key tiles, 8 splits) flipped a tie 0.016 apart at step 1 of one sequence.
    example = _example()
    results = example.run(new_tokens=16, page_sizes=(None, 16), dtype=torch.float32)
    for kind, (tokens, expected, _) in results.items():
        assert torch.equal(tokens, expected), kind
    results = example.run(new_tokens=16, page_sizes=(None, 1, 16, 256), dtype=torch.bfloat16)
    for kind, (tokens, expected, margins) in results.items():
        for b in range(tokens.shape[0]):
            differ = (tokens[b] != expected[b]).nonzero()
            if len(differ):
                step = int(differ[0])
                assert margins[b, step] < 0.1 and step >= 1, (kind, b, step, float(margins[b, step]))
