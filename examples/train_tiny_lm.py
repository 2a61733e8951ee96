"""Train a tiny Llama on a shipped text twice: with transformers' own loss and with linear_ce.

Both runs start from the same random weights and see the same batches; the
only difference is that the second model is ``linear_ce.integrations.
transformers.patch``-ed, so its training loss comes from the hidden states
and ``lm_head.weight`` without ever building the ``(batch, seq, vocab)``
logits. The loss curves must coincide; the script plots them (and their
difference) to ``--out`` and prints the peak memory of each run's training
step (forward + loss + backward).

Everything is local: the tokenizer is a word-level vocabulary built from the
text, the model is randomly initialised from a small ``LlamaConfig``, and it
runs on the CPU in a couple of minutes::

    python examples/train_tiny_lm.py --out docs/train_tiny_lm.png

Each run happens in its own subprocess, so the peak memory is that run's
alone: before each step the script notes the resident set size (VmRSS) and
resets the kernel's high-water mark; after it, VmHWM minus that VmRSS is the
step's transient peak, and the largest over all steps is reported.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_TEXT = HERE / "data" / "fables.txt"
DEFAULT_OUT = HERE.parent / "docs" / "train_tiny_lm.png"
VARIANTS = {"plain": "transformers loss (full logits)", "linear_ce": "linear_ce (no logits)"}


def tokenize(text: str) -> list[str]:
    """Lower-cased words, punctuation marks and paragraph breaks."""
    return re.findall(r"[a-z]+(?:'[a-z]+)?|[^\sa-z]|\n\n", text.lower())


def encode(path: pathlib.Path) -> tuple[list[int], list[str]]:
    """Token ids of the text and the vocabulary (most frequent first, ``<pad>`` = 0)."""
    words = tokenize(path.read_text(encoding="utf-8"))
    vocab = ["<pad>", *(word for word, _ in collections.Counter(words).most_common())]
    index = {word: i for i, word in enumerate(vocab)}
    return [index[word] for word in words], vocab


def peak_tracker():
    """Callables ``start()`` and ``stop() -> bytes`` around a region, from /proc/self."""

    def read(key: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key))

    base = [0]

    def start() -> None:
        base[0] = read("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")

    def stop() -> int:
        return read("VmHWM") - base[0]

    return start, stop


def train(args: argparse.Namespace) -> dict:
    """One run; returns its per-step losses, peak step memory and sizes."""
    import torch
    import transformers

    from linear_ce.integrations.transformers import patch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ids, vocab = encode(args.text)
    data = torch.tensor(ids)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    if args.variant == "linear_ce":
        patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = torch.Generator().manual_seed(args.seed + 1)
    start, stop = peak_tracker()

    losses, peak = [], 0
    began = time.perf_counter()
    for _ in range(args.steps):
        offsets = torch.randint(0, len(data) - args.seq, (args.batch,), generator=batches)
        tokens = torch.stack([data[o : o + args.seq] for o in offsets.tolist()])
        start()
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        peak = max(peak, stop())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "losses": losses,
        "peak_bytes": peak,
        "seconds": time.perf_counter() - began,
        "vocab": len(vocab),
        "batch": args.batch,
        "seq": args.seq,
        "tokens": len(ids),
        "logits_bytes": args.batch * args.seq * len(vocab) * 4,
        "dtype": args.dtype,
    }


def plot(results: dict[str, dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain, fused = results["plain"], results["linear_ce"]
    steps = range(1, len(plain["losses"]) + 1)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for name, style in (("plain", {"lw": 3, "alpha": 0.5}), ("linear_ce", {"lw": 1, "ls": "--"})):
        result = results[name]
        label = f"{VARIANTS[name]}: peak step memory {result['peak_bytes'] / 2**20:.0f} MiB"
        top.plot(steps, result["losses"], label=label, **style)
    top.set_ylabel("training loss (nats/token)")
    top.set_title(
        f"Tiny Llama ({plain['dtype']}), word vocab {plain['vocab']:,}, "
        f"{plain['batch']}×{plain['seq']} tokens/step "
        f"(logits {plain['logits_bytes'] / 2**20:.0f} MiB)"
    )
    top.legend()
    diff = [abs(a - b) for a, b in zip(plain["losses"], fused["losses"], strict=True)]
    bottom.semilogy(steps, [max(d, 1e-9) for d in diff], color="k", lw=0.8)
    bottom.set_ylabel("|difference|\n(0 drawn at 1e-9)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=pathlib.Path, default=DEFAULT_TEXT)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="PNG to write")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the model's dtype (bfloat16: a pure bf16 run, no autocast)",
    )
    parser.add_argument("--threads", type=int, help="torch threads per run (default: torch's)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.variant is not None:
        args.result.write_text(json.dumps(train(args)))
        return

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for variant in VARIANTS:
            result = pathlib.Path(scratch) / f"{variant}.json"
            subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--result", result],
                check=True,
            )
            results[variant] = json.loads(result.read_text())
    plot(results, args.out)

    plain, fused = results["plain"], results["linear_ce"]
    worst = max(abs(a - b) for a, b in zip(plain["losses"], fused["losses"], strict=True))
    print(
        f"text: {plain['tokens']:,} tokens, vocab {plain['vocab']:,}; {args.steps} steps of "
        f"{args.batch}x{args.seq} tokens; logits per step {plain['logits_bytes'] / 2**20:.1f} MiB"
    )
    for name, result in results.items():
        print(
            f"{VARIANTS[name]:>32}: first loss {result['losses'][0]:.4f}, last "
            f"{result['losses'][-1]:.4f}, peak step memory {result['peak_bytes'] / 2**20:6.1f} MiB, "
            f"{result['seconds']:.0f} s"
        )
    print(f"largest |loss difference| over all steps: {worst:.2e}")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
