"""The decoder against HF transformers on the same tiny random weights (fast oracle)."""

import pytest
import torch

from kvpool import SamplingParams

transformers = pytest.importorskip("transformers")


def hf_model(loaded):
    c = loaded.config
    hc = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=c.rope_theta,
    )
    m = transformers.LlamaForCausalLM(hc).eval()
    missing, unexpected = m.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    m.tie_weights()
    return m


def test_greedy_tokens_equal_transformers(tiny_model, tiny_engine_factory):
    ref = hf_model(tiny_model)
    g = torch.Generator().manual_seed(3)
    items = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    # float32 weights: the same arithmetic as transformers (mixed lengths, chunked, batched)
    eng = tiny_engine_factory(max_num_batched_tokens=24, weights="float32")
    for i, p in enumerate(items):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
    for i, p in enumerate(items):
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([p]),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert done[i] == want, f"prompt {i}"
