"""Distil a tiny Llama from its teacher's stored top-k log-probabilities (sparse distillation).

The round trip an offline distillation pipeline makes, at a size that runs on a CPU:

1. train a teacher (a tiny Llama) on a shipped text, keeping its weights of best held-out loss;
2. run it once over the training text and store, per position, its ``k`` most likely next
   tokens and their log-probabilities (``linear_ce.token_logprobs(..., topk=k)``: no
   ``(N, V)`` logits; ids ``int32``, log-probs ``bfloat16``: the usual storage) in a file;
3. train a smaller student from that file with ``linear_ce.sparse_divergence`` (forward KL
   against the stored top-k: the teacher is never run again), once per treatment of the
   teacher's mass outside its top-k (``mass="renormalize"`` and ``mass="rest"``), next to
   the same student trained on the hard labels alone (``linear_ce.linear_cross_entropy``),
   all from the same initial weights and batches.

The plot (``--out``) shows the students' distillation losses falling, and every student's
cross-entropy on held-out text (the last tenth of it, which also picks the teacher's
checkpoint: a demonstration, not a benchmark) against the teacher's::

    python examples/sparse_distillation.py --out docs/sparse_distillation.png
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from train_tiny_lm import encode  # noqa: E402  (the sibling example's word-level tokenizer)

DEFAULT_TEXT = HERE / "data" / "fables.txt"
DEFAULT_OUT = HERE.parent / "docs" / "sparse_distillation.png"
#: The students: from the stored top-k with each ``mass`` treatment, and on hard labels.
STUDENTS = {
    "renormalize": 'from the top-k, mass="renormalize"',
    "rest": 'from the top-k, mass="rest"',
    "hard": "on the hard labels only",
}


def tiny_llama(vocab: int, hidden: int, layers: int, seq: int, seed: int):
    """A randomly initialised ``LlamaForCausalLM`` (untied head) in float32."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def hidden_states(model, tokens):
    """The last hidden states ``(batch, seq, hidden)`` and the head's weight ``(V, hidden)``."""
    return model.model(input_ids=tokens, use_cache=False).last_hidden_state, model.lm_head.weight


def windows(ids: list[int], seq: int):
    """The token ids cut into consecutive windows ``(count, seq)``."""
    import torch

    data = torch.tensor(ids)
    count = len(data) // seq
    return data[: count * seq].view(count, seq)


def train_teacher(args, train, held, vocab: int):
    """The teacher, trained on random windows with ``linear_cross_entropy``; the weights of
    its best held-out cross-entropy (checked every ``eval_every`` steps) are kept: on a text
    this small a longer run only memorises it."""
    import copy

    import torch

    import linear_ce

    model = tiny_llama(vocab, args.teacher_hidden, args.teacher_layers, args.seq, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = torch.Generator().manual_seed(args.seed + 1)
    best = (held_out_loss(model, held), copy.deepcopy(model.state_dict()))
    for step in range(1, args.teacher_steps + 1):
        tokens = train[torch.randint(0, len(train), (args.batch,), generator=batches)]
        hidden, weight = hidden_states(model, tokens)
        loss = linear_ce.linear_cross_entropy(hidden, weight, tokens, shift=True)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.teacher_steps:
            held_loss = held_out_loss(model, held)
            if held_loss < best[0]:
                best = (held_loss, copy.deepcopy(model.state_dict()))
    model.load_state_dict(best[1])
    return model.eval(), best[0]


def store_teacher(model, train, k: int, path: pathlib.Path) -> None:
    """Run the teacher once over every training window; store its top-k per position.

    ``shift=True`` scores position ``t`` against token ``t + 1``, as the student does: the
    last position of each window has no next token, so its slots are empty (id ``-1``,
    log-prob ``-inf``), and the student, also ``shift=True``, never reads them."""
    import torch

    import linear_ce

    with torch.no_grad():
        hidden, weight = hidden_states(model, train)
        out = linear_ce.token_logprobs(hidden, weight, train, shift=True, topk=k)
    torch.save(
        {"ids": out.topk_ids.to(torch.int32), "logprobs": out.topk_logprobs.to(torch.bfloat16)},
        path,
    )


def held_out_loss(model, held) -> float:
    """The model's mean next-token cross-entropy on the held-out windows."""
    import torch

    import linear_ce

    with torch.no_grad():
        hidden, weight = hidden_states(model, held)
        return float(linear_ce.linear_cross_entropy(hidden, weight, held, shift=True))


def train_student(args, train, held, vocab: int, store: pathlib.Path, mass: str | None) -> dict:
    """A student trained from the stored top-k in ``store`` with the treatment ``mass`` or,
    for ``None``, on the hard labels; its per-step training loss and its held-out
    cross-entropy along the way."""
    import torch

    import linear_ce

    stored = torch.load(store) if mass is not None else None
    model = tiny_llama(vocab, args.hidden, args.layers, args.seq, args.seed + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = torch.Generator().manual_seed(args.seed + 3)
    losses, evaluations = [], []
    for step in range(args.steps):
        if step % args.eval_every == 0:
            evaluations.append((step, held_out_loss(model, held)))
        rows = torch.randint(0, len(train), (args.batch,), generator=batches)
        tokens = train[rows]
        hidden, weight = hidden_states(model, tokens)
        if stored is None:
            loss = linear_ce.linear_cross_entropy(hidden, weight, tokens, shift=True)
        else:
            # The teacher's top-k at position t is its distribution of token t + 1, as the
            # student's hidden state at t: the slots are aligned with the hidden states, and
            # shift=True only marks the last position (it has no next token) as ignored.
            loss = linear_ce.sparse_divergence(
                hidden,
                weight,
                stored["ids"][rows],
                stored["logprobs"][rows],
                tokens,
                shift=True,
                mass=mass,
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    evaluations.append((args.steps, held_out_loss(model, held)))
    return {"losses": losses, "evaluations": evaluations}


def plot(results: dict, args, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in STUDENTS:
        if name != "hard":
            left.plot(range(1, args.steps + 1), results[name]["losses"], lw=1, label=name)
    left.set_xlabel("student step")
    left.set_ylabel("forward KL to the stored top-k (nats/token)")
    left.set_title(f"sparse_divergence from the stored top-{args.k}")
    left.legend(title="mass=")
    for name, label in STUDENTS.items():
        steps, values = zip(*results[name]["evaluations"], strict=True)
        right.plot(steps, values, marker="o", ms=3, label=label)
    right.axhline(results["teacher_held_out"], color="k", ls=":", label="teacher (stored)")
    right.set_xlabel("student step")
    right.set_ylabel("held-out cross-entropy (nats/token)")
    right.set_title("the students on held-out text")
    right.legend()
    fig.suptitle(
        f"Tiny Llamas on {results['tokens']:,} words (vocab {results['vocab']:,}): teacher "
        f"{args.teacher_hidden}×{args.teacher_layers}, student {args.hidden}×{args.layers}",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=pathlib.Path, default=DEFAULT_TEXT)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="PNG to write")
    parser.add_argument("--store", type=pathlib.Path, help="keep the teacher's top-k file here")
    parser.add_argument("--k", type=int, default=32, help="teacher slots stored per position")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--teacher-steps", type=int, default=100)
    parser.add_argument("--teacher-hidden", type=int, default=64)
    parser.add_argument("--teacher-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120, help="student steps")
    parser.add_argument("--hidden", type=int, default=32, help="the student's hidden size")
    parser.add_argument("--layers", type=int, default=1, help="the student's layers")
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ids, vocab = encode(args.text)
    split = len(ids) * 9 // 10
    train, held = windows(ids[:split], args.seq), windows(ids[split:], args.seq)
    began = time.perf_counter()
    teacher, teacher_held_out = train_teacher(args, train, held, len(vocab))
    results = {"tokens": len(ids), "vocab": len(vocab), "teacher_held_out": teacher_held_out}
    with tempfile.TemporaryDirectory() as scratch:
        store = args.store or pathlib.Path(scratch) / "teacher_topk.pt"
        store_teacher(teacher, train, args.k, store)
        size = store.stat().st_size
        del teacher  # from here on only the file speaks for the teacher
        for name in STUDENTS:
            mass = None if name == "hard" else name
            results[name] = train_student(args, train, held, len(vocab), store, mass)
    plot(results, args, args.out)

    print(
        f"text: {len(ids):,} words, vocab {len(vocab):,}; {len(train)} training windows of "
        f"{args.seq}; stored top-{args.k}: {size / 2**20:.2f} MiB (dense fp32 log-probs would "
        f"be {train.numel() * len(vocab) * 4 / 2**20:.0f} MiB)"
    )
    for name in ("renormalize", "rest"):
        losses = results[name]["losses"]
        print(
            f"distillation loss, mass={name!r}: first {losses[0]:.3f}, last {losses[-1]:.3f} "
            f"nats/token"
        )
    held_out = ", ".join(f"{name} {results[name]['evaluations'][-1][1]:.3f}" for name in STUDENTS)
    print(
        f"held-out cross-entropy: teacher {results['teacher_held_out']:.3f}; students after "
        f"{args.steps} steps: {held_out}"
    )
    print(f"{time.perf_counter() - began:.0f} s; plot: {args.out}")


if __name__ == "__main__":
    main()
