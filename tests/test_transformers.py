"""linear_ce.integrations.transformers against the models' own (logits-building) loss.

The reference is always the same model unpatched, in float32: transformers'
ForCausalLMLoss on the full logits.
"""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from linear_ce.integrations import transformers as lce_hf  # noqa: E402

VOCAB = 151
FAMILY_CONFIG = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {}),
    "GemmaForCausalLM": ("GemmaConfig", {"head_dim": 8}),
    "Gemma2ForCausalLM": (
        "Gemma2Config",
        {"head_dim": 8, "final_logit_softcapping": 3.0, "sliding_window": 4},
    ),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        {"head_dim": 8, "final_logit_softcapping": 3.0, "sliding_window": 4},
    ),
    "Phi3ForCausalLM": ("Phi3Config", {}),
    "PhiForCausalLM": ("PhiConfig", {}),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "Starcoder2ForCausalLM": ("Starcoder2Config", {}),
    "SmolLM3ForCausalLM": ("SmolLM3Config", {}),
    # Families that scale their logits (linear_ce's logit_scale); a plain lm_head would miss it.
    "CohereForCausalLM": ("CohereConfig", {"logit_scale": 0.3}),
    "Cohere2ForCausalLM": ("Cohere2Config", {"logit_scale": 0.3, "sliding_window": 4}),
    "GraniteForCausalLM": ("GraniteConfig", {"logits_scaling": 4.0}),
    "FalconH1ForCausalLM": (
        "FalconH1Config",
        {
            "lm_head_multiplier": 0.5,
            "mamba_d_ssm": 32,
            "mamba_n_heads": 4,
            "mamba_d_head": 8,
            "mamba_d_state": 8,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 4,
            "head_dim": 8,
        },
    ),
}
FAMILIES = [name for name in FAMILY_CONFIG if hasattr(transformers, name)]
# Older transformers (4.46) has no shift_labels in its loss: its models ignore them.
LOSS_TAKES_SHIFT_LABELS = "shift_labels" in inspect.signature(ForCausalLMLoss).parameters


def tiny_model(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer random model of ``name`` whose logits are large enough for a softcap of 3 to matter."""
    config_name, extra = FAMILY_CONFIG[name]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **{**extra, **overrides},
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, name)(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
        if model.lm_head.bias is not None:
            model.lm_head.bias.normal_()
    return model


def batch(seed: int, size: int = 2, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, length), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[-1, 5:7] = -100
    return ids, labels


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.double()
    diff = (got.double() - ref64).norm().item()
    scale = ref64.norm().item()
    return diff / scale if scale > 0 else diff


def assert_same_grads(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    worst = max(ref, key=lambda name: rel_err(got[name], ref[name]))
    assert rel_err(got[worst], ref[worst]) <= 1e-5, worst


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_every_gradient_match_the_model(name):
    model = tiny_model(name)
    ids, labels = batch(1)
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    ref_grads = grads(model)
    if lce_hf.SUPPORTED_MODELS[name]:
        assert ref.logits.abs().max() > 0.9 * model.config.final_logit_softcapping
    assert (
        ref_grads[
            "lm_head.weight" if "lm_head.weight" in ref_grads else "model.embed_tokens.weight"
        ].norm()
        > 0
    )

    lce_hf.patch(model)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None
    assert out.loss.dtype == torch.float32
    assert rel_err(out.loss.detach(), ref.loss.detach()) <= 1e-5
    assert_same_grads(grads(model), ref_grads)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_gradient_accumulation_equals_one_big_batch(name):
    model = tiny_model(name)
    ids, labels = batch(2, size=4)
    labels[2, :] = -100
    ref = model(input_ids=ids, labels=labels).loss
    ref.backward()
    ref_grads = grads(model)

    lce_hf.patch(model)
    num_items = (labels[:, 1:] != -100).sum()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        out = model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=num_items)
        out.loss.backward()
        total += out.loss.item()
    assert total == pytest.approx(ref.item(), rel=1e-5)
    assert_same_grads(grads(model), ref_grads)


def test_tied_embeddings_share_one_gradient():
    model = tiny_model("LlamaForCausalLM", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, labels = batch(3)
    model(input_ids=ids, labels=labels).loss.backward()
    ref_grads = grads(model)
    lce_hf.patch(model)(input_ids=ids, labels=labels).loss.backward()
    got = grads(model)
    assert "lm_head.weight" not in got
    assert_same_grads(got, ref_grads)


def test_shift_labels_ignore_index_and_tuple_output_match_the_model():
    model = tiny_model("Qwen3ForCausalLM" if "Qwen3ForCausalLM" in FAMILIES else "Qwen2ForCausalLM")
    ids, labels = batch(4)
    shift_labels = torch.roll(labels, -2, dims=-1)
    shift_labels[:, -2:] = -100
    odd_labels = torch.where(labels == -100, -1, labels)
    calls = [
        {"labels": odd_labels, "ignore_index": -1},
        {"labels": labels, "return_dict": False},
        {"labels": labels, "logits_to_keep": 0, "output_hidden_states": True},
    ]
    if LOSS_TAKES_SHIFT_LABELS:
        calls.append({"labels": labels, "shift_labels": shift_labels})
    refs = [model(input_ids=ids, **kwargs) for kwargs in calls]
    lce_hf.patch(model)
    for kwargs, ref in zip(calls, refs, strict=True):
        out = model(input_ids=ids, **kwargs)
        if kwargs.get("return_dict") is False:
            assert isinstance(out, tuple) and len(out) == len(ref) - 1
            out, ref = (out[0], None), (ref[0], ref[1])
        else:
            assert out.logits is None
            if "output_hidden_states" in kwargs:
                assert all(
                    torch.equal(a, b)
                    for a, b in zip(out.hidden_states, ref.hidden_states, strict=True)
                )
        assert rel_err(out[0].detach(), ref[0].detach()) <= 1e-5


def test_inference_is_unchanged_and_unpatch_restores_the_model():
    model = tiny_model("Gemma2ForCausalLM")
    ids, labels = batch(5)
    with torch.no_grad():
        plain = model(input_ids=ids, labels=labels)
        plain_kept = model(input_ids=ids, logits_to_keep=1)
        assert not lce_hf.is_patched(model)
        lce_hf.patch(model)
        assert lce_hf.is_patched(model) and lce_hf.patch(model) is model
        assert model(input_ids=ids, labels=labels).logits is None
        assert torch.equal(model(input_ids=ids, logits_to_keep=1).logits, plain_kept.logits)
        lce_hf.unpatch(model)
        assert not lce_hf.is_patched(model)
        again = model(input_ids=ids, labels=labels)
    assert torch.equal(again.loss, plain.loss) and torch.equal(again.logits, plain.logits)
    with pytest.raises(ValueError, match="was not patched"):
        lce_hf.unpatch(model)


def test_patch_model_class_patches_new_instances_until_undone():
    cls = transformers.MistralForCausalLM
    ids, labels = batch(6)
    plain = tiny_model("MistralForCausalLM")
    ref = plain(input_ids=ids, labels=labels)
    try:
        assert lce_hf.patch_model_class(cls) is cls
        fresh = tiny_model("MistralForCausalLM")
        assert lce_hf.is_patched(fresh) and lce_hf.is_patched(plain)
        out = fresh(input_ids=ids, labels=labels)
        assert out.logits is None
        assert rel_err(out.loss.detach(), ref.loss.detach()) <= 1e-5
    finally:
        lce_hf.unpatch_model_class(cls)
    restored = tiny_model("MistralForCausalLM")(input_ids=ids, labels=labels)
    assert torch.equal(restored.logits, ref.logits) and torch.equal(restored.loss, ref.loss)
    with pytest.raises(ValueError, match="was not patched by patch_model_class"):
        lce_hf.unpatch_model_class(cls)


def test_unpatch_refuses_to_drop_a_wrapper_put_on_after_patch():
    """A wrapper put on ``forward`` after ``patch`` (as accelerate's hooks are, copying the
    wrapped function's attributes) stays: unpatch says so and changes nothing."""
    model = lce_hf.patch(tiny_model("LlamaForCausalLM"))
    ours = model.forward
    wrapper = functools.update_wrapper(functools.partial(lambda *a, **k: ours(*a, **k)), ours)
    model.forward = wrapper
    assert lce_hf.is_patched(model)
    assert lce_hf.patch(model) is model and model.forward is wrapper  # already patched
    with pytest.raises(ValueError, match=r"wrapped again after patch\(\).*remove the wrapper"):
        lce_hf.unpatch(model)
    assert model.forward is wrapper
    model.forward = ours
    lce_hf.unpatch(model)
    assert not lce_hf.is_patched(model) and "forward" not in vars(model)


def test_unpatch_model_class_refuses_to_drop_a_later_patch():
    """Another patch of ``cls.forward`` on top of ours, made with functools.wraps (which
    copies our marker onto it), used to be taken for ours and overwritten by unpatch."""
    cls = transformers.Qwen2ForCausalLM
    original = vars(cls)["forward"]
    lce_hf.patch_model_class(cls)
    ours = vars(cls)["forward"]

    @functools.wraps(ours)
    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    try:
        cls.forward = theirs
        assert lce_hf.patch_model_class(cls) is cls and vars(cls)["forward"] is theirs
        with pytest.raises(ValueError, match=r"patched again after patch_model_class\(\)"):
            lce_hf.unpatch_model_class(cls)
        assert vars(cls)["forward"] is theirs
        cls.forward = ours
        lce_hf.unpatch_model_class(cls)
        assert vars(cls)["forward"] is original
    finally:
        cls.forward = original


def test_overlapping_loss_calls_through_one_head_leave_it_unchanged():
    """Two threads compute the loss through one ``lm_head``, whose forward is swapped for
    the call. Each used to restore the forward it saw on entry: the second restored the
    first one's loss forward after the first had removed it, and ``lm_head`` kept it.
    Hooks on the head force that order where the calls are not serialised (each wait is
    bounded, and simply times out where they are)."""
    import threading

    model = lce_hf.patch(tiny_model("LlamaForCausalLM"))
    ids, labels = batch(7)
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels).loss
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()
    names = {}

    def hold(module, args):
        if threading.current_thread() is names["first"]:
            first_in.set()
            second_in.wait(timeout=2)
        else:
            second_in.set()
            first_done.wait(timeout=2)

    losses = {}

    def run(key):
        if key == "second":
            first_in.wait(timeout=30)
        with torch.no_grad():
            losses[key] = model(input_ids=ids, labels=labels).loss
        if key == "first":
            first_done.set()

    handle = model.lm_head.register_forward_pre_hook(hold)
    try:
        threads = {key: threading.Thread(target=run, args=(key,)) for key in ("first", "second")}
        names.update(threads)
        for thread in threads.values():
            thread.start()
        for thread in threads.values():
            thread.join(timeout=60)
    finally:
        handle.remove()
    assert "forward" not in vars(model.lm_head)
    # The same call on the same inputs: the same bits.
    assert torch.equal(losses["first"], ref) and torch.equal(losses["second"], ref)
    hidden = torch.randn(3, model.config.hidden_size)
    assert torch.equal(model.lm_head(hidden), hidden @ model.lm_head.weight.T)


def test_lm_head_weight_is_read_inside_its_own_call():
    """A ZeRO-3-like head: its weight is empty except between its pre- and post-forward hooks."""
    model = tiny_model("LlamaForCausalLM")
    ids, labels = batch(7)
    head = model.lm_head
    full = head.weight.data
    calls = []

    def gather(module, args):
        calls.append("gather")
        module.weight.data = full

    def release(module, args, output):
        calls.append("release")
        module.weight.data = torch.empty(0)

    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels).loss
        head.register_forward_pre_hook(gather)
        head.register_forward_hook(release)
        head.weight.data = torch.empty(0)
        out = lce_hf.patch(model)(input_ids=ids, labels=labels)
    assert calls == ["gather", "release"]
    assert rel_err(out.loss, ref) <= 1e-5


def _autocast_loss(model, ids, labels, monkeypatch):
    """The patched ``model``'s loss under bf16 autocast (backward run), the hidden states
    entering ``lm_head`` and the dtypes ``linear_cross_entropy`` was handed."""
    seen, hidden = [], []
    real = lce_hf.linear_cross_entropy

    def spy(input, linear_weight, target, **kwargs):
        seen.append((input.dtype, linear_weight.dtype))
        return real(input, linear_weight, target, **kwargs)

    monkeypatch.setattr(lce_hf, "linear_cross_entropy", spy)
    handle = model.lm_head.register_forward_pre_hook(lambda m, args: hidden.append(args[0]))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lce_hf.patch(model)(input_ids=ids, labels=labels).loss
    finally:
        handle.remove()
    out.backward()
    return out.detach(), hidden[0].detach(), seen


def test_autocast_keeps_fp32_parameters_in_fp32(monkeypatch):
    """An fp32 model under bf16 autocast: the loss runs in fp32, the parameters' dtype
    (issue 29 item 14), so it is within fp32 rounding of the float64 loss on the hidden
    states entering lm_head, where the model's own bf16 head is ~1e-3 off."""
    model = tiny_model("LlamaForCausalLM")
    ids, labels = batch(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = model(input_ids=ids, labels=labels).loss.detach()
    out, hidden, seen = _autocast_loss(model, ids, labels, monkeypatch)
    assert seen == [(torch.float32, torch.float32)]
    assert out.dtype == model.lm_head.weight.grad.dtype == torch.float32

    def plain(dtype):
        logits = (hidden.to(dtype) @ model.lm_head.weight.detach().to(dtype).T)[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
        )

    want, own = plain(torch.float64), plain(torch.float32)
    # Twice the plain fp32 expression's own error (house rule), at least 3 eps(fp32).
    bound = max(3 * torch.finfo(torch.float32).eps, 2 * rel_err(own, want))
    assert rel_err(out, want) <= bound < rel_err(theirs, want)


def test_autocast_runs_a_bf16_model_in_bf16(monkeypatch):
    """A bf16 model under bf16 autocast: the loss runs in bf16, as lm_head itself does."""
    model = tiny_model("LlamaForCausalLM").to(torch.bfloat16)
    ids, labels = batch(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(input_ids=ids, labels=labels).loss.detach()
    out, _, seen = _autocast_loss(model, ids, labels, monkeypatch)
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert model.lm_head.weight.grad.dtype == torch.bfloat16
    # Both losses sum the same bf16-rounded logits, in other orders: a few bf16 roundings.
    assert rel_err(out, ref) <= 3 * torch.finfo(torch.bfloat16).eps


def test_compiled_patched_model_matches_the_model():
    model = tiny_model("Qwen2ForCausalLM")
    ids, labels = batch(9)
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    ref_grads = grads(model)
    torch._dynamo.reset()
    out = torch.compile(lce_hf.patch(model), backend="eager")(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None
    assert rel_err(out.loss.detach(), ref.loss.detach()) <= 1e-5
    assert_same_grads(grads(model), ref_grads)


def test_unsupported_models_are_refused_with_the_supported_list():
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    )
    with pytest.raises(TypeError, match=r"GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        lce_hf.patch(gpt2)
    with pytest.raises(TypeError, match="is not supported"):
        lce_hf.patch_model_class(transformers.GPT2LMHeadModel)

    class Custom(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with pytest.raises(TypeError, match="overrides forward"):
        lce_hf.patch(Custom(tiny_model("LlamaForCausalLM").config))

    model = tiny_model("LlamaForCausalLM")
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(TypeError, match=r"lm_head must be a torch.nn.Linear"):
        lce_hf.patch(model)

    model = tiny_model("LlamaForCausalLM")
    model.forward = functools.partial(type(model).forward, model)
    with pytest.raises(TypeError, match="already has its own forward"):
        lce_hf.patch(model)

    class CustomLoss(transformers.LlamaForCausalLM):
        @property
        def loss_function(self):
            return lambda logits, labels, vocab_size, **kwargs: logits.sum()

    with pytest.raises(TypeError, match="ForCausalLMLoss"):
        lce_hf.patch(CustomLoss(tiny_model("LlamaForCausalLM").config))


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import torch, transformers
    from linear_ce.integrations.transformers import patch

    V, B, T = 50_000, 8, 256
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = patch(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, V, (B, T))

    def step():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out

    step()

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = step()
    print(status("VmHWM") - before, int(out.logits is None))
    """
)


@pytest.mark.slow
def test_training_step_never_allocates_the_logits():
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    peak, no_logits = map(int, result.stdout.split()[-2:])
    logits_bytes = 8 * 256 * 50_000 * 4
    assert no_logits == 1
    assert peak < 0.25 * logits_bytes, (
        f"peak {peak / 1e6:.1f} MB vs logits {logits_bytes / 1e6:.0f} MB"
    )
