"""Train a tiny model with TRL's SFTTrainer, with TRL's own fused LM head and patched.

TRL gives every model its ``SFTTrainer`` trains a fused LM head, which computes the
per-token log-probabilities (and the entropy and token accuracy it logs) in chunks of its
own. ``linear_ce.integrations.trl.patch()`` makes that head run on
``linear_ce.token_logprobs``. This script trains the same model on the same batches twice,
once per head, each in its own process, and prints the losses and metrics of each step and
the speed and peak memory of a training step.

Everything is local: a word-level tokenizer over a synthetic vocabulary (32k words by
default), random "sentences" drawn from it with Zipf-like frequencies, and a Llama with
random weights::

    python examples/sft_with_trl.py                     # fp32
    python examples/sft_with_trl.py --dtype bfloat16    # a bf16 model, TRL's bf16=True

Memory of a step: before each step the script resets the kernel's high-water mark of the
resident set (VmHWM); after it, VmHWM is the process's peak during that step (the model,
optimizer state and Python included, the same in both runs), and VmHWM minus the VmRSS
before the step is the memory the step added. Memory the allocator kept from the previous
step is not in the second number (a buffer reused each step counts once, before the
timed steps), so the first is the one to compare. The first step (which also allocates
AdamW's state) is left out of the time and the memory, which are the median and the
largest over the other steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

VARIANTS = {"trl": "TRL's fused head", "linear_ce": "patched: linear_ce"}
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def peak_tracker():
    """Callables ``start()`` and ``stop() -> (peak, added)`` bytes around a region, from
    /proc/self: the resident peak during the region, and that peak minus the resident
    size at its start."""

    def read(key: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key))

    base = [0]

    def start() -> None:
        base[0] = read("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")

    def stop() -> tuple[int, int]:
        peak = read("VmHWM")
        return peak, peak - base[0]

    return start, stop


def tokenizer(vocab_size: int):
    """A word-level tokenizer over ``w0 w1 ...``; its ids are the model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*SPECIAL, *(f"w{i}" for i in range(vocab_size - len(SPECIAL)))]
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def sentences(count: int, length: int, words: int, seed: int) -> list[str]:
    """``count`` texts of ``length`` words, word ``k`` drawn with weight ``1 / (k + 1)``."""
    import torch

    weights = 1.0 / torch.arange(1, words + 1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(weights, count * length, replacement=True, generator=gen)
    return [" ".join(f"w{i}" for i in row) for row in ids.view(count, length).tolist()]


def train(args: argparse.Namespace) -> dict:
    """One run; returns each step's logged values, seconds and peak bytes."""
    import datasets
    import torch
    import transformers
    from trl import SFTConfig, SFTTrainer

    from linear_ce.integrations import trl as linear_ce_trl

    # Only this script's table on the terminal: no progress bars, log lines or deprecations.
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.variant == "linear_ce":
        linear_ce_trl.patch()
    start, stop = peak_tracker()
    steps: list[dict] = []

    class Step(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            start()
            self.began = time.perf_counter()

        def on_step_end(self, *_, **__):
            peak, added = stop()
            steps.append(
                {"seconds": time.perf_counter() - self.began, "peak": peak, "added": added}
            )

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq + 1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    texts = sentences(args.batch * args.steps, args.seq, args.vocab - len(SPECIAL), args.seed)
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(
            output_dir=args.scratch,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            max_length=args.seq,
            learning_rate=1e-3,
            logging_steps=1,
            # TRL's default is bf16 autocast, also on CPU; here it follows --dtype.
            bf16=args.dtype == "bfloat16",
            use_cpu=True,
            seed=args.seed,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=tokenizer(args.vocab),
        callbacks=[Step()],
    )
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    for step, entry in zip(steps, logs, strict=True):
        step.update({k: entry[k] for k in ("loss", "entropy", "mean_token_accuracy")})
    return {"steps": steps, "tokens": args.batch * args.seq}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the model's dtype (bfloat16 also turns on TRL's bf16=True)",
    )
    parser.add_argument("--threads", type=int, help="torch threads per run (default: torch's)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out of the timings")

    if args.variant is not None:
        args.result.write_text(json.dumps(train(args)))
        return

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for variant in VARIANTS:
            result = pathlib.Path(scratch) / f"{variant}.json"
            command = [*sys.argv[1:], "--variant", variant, "--result", result]
            subprocess.run([sys.executable, __file__, *command, "--scratch", scratch], check=True)
            results[variant] = json.loads(result.read_text())

    tokens = results["trl"]["tokens"]
    logits = tokens * args.vocab * 4
    print(
        f"SFTTrainer, Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab:,}, "
        f"{args.dtype}; {args.batch}x{args.seq} = {tokens:,} tokens/step "
        f"(fp32 logits would be {logits / 2**20:.0f} MiB)"
    )
    print(f"{'step':>4} " + " ".join(f"{VARIANTS[v] + ' loss':>28}" for v in VARIANTS))
    for i, rows in enumerate(zip(*(results[v]["steps"] for v in VARIANTS), strict=True)):
        print(f"{i + 1:>4} " + " ".join(f"{row['loss']:>28.6f}" for row in rows))
    summary = {}
    for variant, result in results.items():
        later = result["steps"][1:]
        seconds = statistics.median(s["seconds"] for s in later)
        peak = max(s["peak"] for s in later)
        added = max(s["added"] for s in later)
        summary[variant] = seconds
        last = result["steps"][-1]
        print(
            f"{VARIANTS[variant]:>18}: {seconds:6.3f} s/step (median of {len(later)}), "
            f"peak RSS during a step {peak / 2**20:7.1f} MiB ({added / 2**20:.1f} MiB added "
            f"by the step); last step entropy {last['entropy']:.4f}, "
            f"mean_token_accuracy {last['mean_token_accuracy']:.4f}"
        )
    print(f"speed-up of a training step: {summary['trl'] / summary['linear_ce']:.2f}x")


if __name__ == "__main__":
    main()
