"""The benchmark report runs end to end at tiny shapes (no timing assertions)."""

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from linear_ce.bench import config
from linear_ce.bench.variants import DEFAULT, VARIANTS, make_inputs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_end_to_end(tmp_path):
    plot, out = tmp_path / "bench.png", tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "linear_ce.bench",
            "--shapes",
            "32,16,64",
            "--dtype",
            "bf16",
            "--sweep",
            "V=32,64",
            "--repeats",
            "1",
            "--ignored",
            "0.5",
            "--reductions",
            "mean,none",
            "--heads",
            "ce,logprobs,objective,divergence,sparse",
            "--plot",
            str(plot),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]

    # The table names every default variant, measured or with the reason it was not.
    for name in DEFAULT:
        assert name in proc.stdout, f"{name} missing from the table:\n{proc.stdout}"

    assert plot.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image

    image = matplotlib.image.imread(plot)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    data = json.loads(out.read_text())
    labels = {(p["V"], p["dtype"], p["head"], p["ignored"], p["reduction"]) for p in data["points"]}
    assert labels == {
        (32, "bf16", "ce", 0.0, "mean"),
        (64, "bf16", "ce", 0.0, "mean"),
        (64, "bf16", "ce", 0.0, "none"),
        (64, "bf16", "ce", 0.5, "mean"),
        (64, "bf16", "ce", 0.5, "none"),
        (64, "bf16", "logprobs", 0.0, "mean"),
        (64, "bf16", "objective", 0.0, "mean"),
        (64, "bf16", "divergence", 0.0, "mean"),
        (64, "bf16", "sparse", 0.0, "mean"),
    }
    # The masked rows are read against the unmasked step, and the run checks its targets.
    assert "× the unmasked step" in proc.stdout and "targets met" in proc.stdout
    checked = {(t["name"], t["dtype"]) for t in data["targets"]}
    assert ("step, 50% ignored, reduction=none (× the unmasked step)", "bf16") in checked
    assert ("token_objective (× its floor)", "bf16") in checked
    assert data["shape"] == [32, 16, 64]
    assert all(
        len(r["repeat_seconds"]) == 1 for p in data["points"] for r in p["rows"] if r["seconds"]
    )
    for point in data["points"]:
        # Each point measures the variants of its head (the floors serve every head); the
        # extra points (masked, or another reduction) keep the floors, plain and linear_ce.
        extra = point["ignored"] > 0 or point["reduction"] != "mean"
        floors = ["floor", "floor-fp32"]
        expected = {
            ("ce", False): [n for n in DEFAULT if "ce" in VARIANTS[n].heads],
            ("ce", True): [*floors, "plain", "linear_ce"],
            ("logprobs", False): [
                *floors,
                "logprobs-plain",
                "logprobs-linear_ce",
                "logprobs-trl",
                "logprobs-trl-patched",
            ],
            ("objective", False): [
                *floors,
                "objective-plain",
                "objective-logprobs",
                "objective-linear_ce",
            ],
            ("divergence", False): [
                *floors,
                "floor-2heads",
                "floor-2heads-fp32",
                "divergence-plain",
                "divergence-linear_ce",
                "divergence-trl",
            ],
            ("sparse", False): [*floors, "sparse-plain", "sparse-linear_ce"],
        }[(point["head"], extra)]
        assert [row["variant"] for row in point["rows"]] == expected
        if point["head"] != "ce" or extra:
            rows = {row["variant"]: row for row in point["rows"]}
            for name in expected:
                if name.startswith("logprobs-trl") and importlib.util.find_spec("trl") is None:
                    assert rows[name]["seconds"] is None, rows[name]
                elif (
                    name.startswith(("logprobs-", "objective-", "divergence-l", "sparse-"))
                    or name == "linear_ce"
                ):
                    assert rows[name]["seconds"] > 0, rows[name]
            continue
        assert point["grad_bytes"] == (point["N"] + point["V"]) * point["D"] * 2
        rows = {row["variant"]: row for row in point["rows"]}
        # Every variant that can run anywhere produced a time; half inputs are
        # measured against the fp32 floor, which is its own reference.
        for name in (
            "floor-fp32",
            "plain",
            "plain-compile",
            "linear_ce",
            "floor-fwd",
            "linear_ce-fwd",
        ):
            assert rows[name]["seconds"] is not None and rows[name]["seconds"] > 0, rows[name]
            assert rows[name]["peak_bytes"] >= 0
        assert rows["floor-fp32"]["ratio"] == pytest.approx(1.0)
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"]


def test_points_sweep_and_dedup():
    points = config.points([(8, 4, 16)], ["fp32", "bf16"], "cpu", ("V", [16, 32]), ["fp32"])
    assert [(p.V, p.dtype) for p in points] == [(16, "fp32"), (32, "fp32"), (16, "bf16")]
    assert points[0].grad_bytes == (8 + 16) * 4 * 4


@pytest.mark.parametrize(
    ("text", "message"),
    [("8,4", "three integers"), ("8,0,4", "positive integer"), ("a,4,4", "positive integer")],
)
def test_bad_shapes(text, message):
    with pytest.raises(ValueError, match=message):
        config.parse_shapes(text)


def test_masked_and_head_points():
    points = config.points(
        [(8, 4, 16)], ["fp32", "bf16"], "cpu", None, ["fp32"], (0.75,), ("ce", "logprobs")
    )
    extra = [(p.dtype, p.ignored, p.head) for p in points if not p.swept]
    assert extra == [("fp32", 0.75, "ce"), ("fp32", 0.0, "logprobs")]
    labels = [p.label for p in points]
    assert labels[1:3] == ["N=8 D=4 V=16 fp32 75% ignored", "N=8 D=4 V=16 fp32 logprobs"]


def test_extra_points_in_several_dtypes_and_reductions():
    points = config.points(
        [(8, 4, 16)],
        ["fp32"],
        "cpu",
        None,
        ["fp32"],
        (0.75,),
        ("ce", "objective"),
        ["fp32", "bf16"],
        ("mean", "none"),
    )
    # Each extra dtype gets its unmasked step (the masked points' reference), a masked point
    # per reduction and the heads; the first dtype's points come first.
    # ("none" recomputes the logits in backward: its masked step is read against its own).
    assert [(p.dtype, p.ignored, p.reduction, p.head) for p in points] == [
        ("fp32", 0.0, "mean", "ce"),
        ("fp32", 0.0, "none", "ce"),
        ("fp32", 0.75, "mean", "ce"),
        ("fp32", 0.75, "none", "ce"),
        ("fp32", 0.0, "mean", "objective"),
        ("bf16", 0.0, "mean", "ce"),
        ("bf16", 0.0, "none", "ce"),
        ("bf16", 0.75, "mean", "ce"),
        ("bf16", 0.75, "none", "ce"),
        ("bf16", 0.0, "mean", "objective"),
    ]
    assert [p.swept for p in points[:2]] == [True, False]
    assert points[3].label == "N=8 D=4 V=16 fp32 75% ignored reduction=none"
    assert config.parse_reductions("none, mean,none") == ["none", "mean"]
    with pytest.raises(ValueError, match="choose from mean, sum, none"):
        config.parse_reductions("avg")


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_the_masked_points_reduction_reaches_the_loss(reduction):
    """At a ``reduction=`` point the variants that take one are built with it: their
    gradients are the plain expression's under that reduction (``"none"``: of the summed
    losses), not the mean's; the floors take every reduction, the others only the mean."""
    import torch.nn.functional as F

    from linear_ce.bench.variants import measured_at

    point = config.Point(16, 8, 32, "fp64", "cpu", ignored=0.5, reduction=reduction)
    x, w, t = make_inputs(point)
    loss = F.cross_entropy(F.linear(x, w), t, reduction="sum")
    grad_x, grad_w = torch.autograd.grad(loss, (x, w))
    for name in ("plain", "linear_ce"):
        x.grad = w.grad = None
        VARIANTS[name].build(x, w, t, reduction=reduction)()
        torch.testing.assert_close(x.grad, grad_x)
        torch.testing.assert_close(w.grad, grad_w)
    here = [name for name in DEFAULT if measured_at(name, point)]
    assert here == ["floor", "floor-fp32", "plain", "linear_ce"]


def _row(variant, ratio, own=None, seconds=1.0, peak_ratio=1.0, **extra):
    from linear_ce.bench.report import Row

    return Row(variant, "train", "floor", seconds, ratio, 1, peak_ratio, "", own, **extra)


def test_masked_rows_read_against_the_unmasked_step():
    """A masked row's ratio over the same variant's at the unmasked point of its shape,
    dtype and reduction: own-dtype ratios for half rows; floors and unmatched points get
    none."""
    from linear_ce.bench.report import with_unmasked

    full = config.Point(8, 4, 16, "bf16", "cpu", reduction="none")
    full_mean = config.Point(8, 4, 16, "bf16", "cpu")
    masked = config.Point(8, 4, 16, "bf16", "cpu", ignored=0.75, reduction="none")
    other = config.Point(8, 4, 32, "bf16", "cpu", ignored=0.75)
    out = with_unmasked(
        [
            (full_mean, [_row("linear_ce", 0.25, 0.8)]),
            (full, [_row("floor", 0.3, 1.0), _row("linear_ce", 0.33, 1.1)]),
            (masked, [_row("floor", 0.3, 1.0), _row("linear_ce", 0.1, 0.33)]),
            (other, [_row("linear_ce", 0.1, 0.3)]),
        ]
    )
    by = {(p, r.variant): r.unmasked_ratio for p, rows in out for r in rows}
    assert by[(masked, "linear_ce")] == pytest.approx(0.3)  # its reduction's, not the mean's
    assert by[(masked, "floor")] is None and by[(full, "linear_ce")] is None
    assert by[(other, "linear_ce")] is None


def test_targets_read_the_runs_paired_ratios():
    from linear_ce.bench import targets

    shape = (8, 4, 16)

    def point(dtype, **kw):
        return config.Point(*shape, dtype, "cpu", **kw)

    summaries = [
        (
            point("fp32"),
            [
                _row("floor", 1.0),
                _row("plain", 1.6, repeat_seconds=[3.0, 3.3, 3.1]),
                # plain-compile's ratio to the floor (1.02) is below the step's (1.04), yet
                # round by round the step ran faster (step / peer 0.95, 1.05, 0.91: median
                # 0.95): the peer is read in pairs, not through the floor.
                _row("plain-compile", 1.02, repeat_seconds=[2.1, 2.1, 2.3]),
                _row("linear_ce", 1.04, peak_ratio=1.24, repeat_seconds=[2.0, 2.2, 2.1]),
                _row("torch-512", 1.2, repeat_seconds=[1.9, 2.5, 2.0]),
                _row("linear_ce-fwd", 1.06),
            ],
        ),
        (point("fp32", reduction="none"), [_row("linear_ce", 1.4)]),
        (point("fp32", ignored=0.75), [_row("linear_ce", 0.3, unmasked_ratio=0.29)]),
        (point("fp32", head="logprobs"), [_row("logprobs-linear_ce", 1.39)]),
        (point("fp32", head="divergence"), [_row("divergence-linear_ce", 1.11)]),
        (
            point("bf16"),
            [
                _row("linear_ce", 0.3, own=1.01, repeat_seconds=[0.5, 0.6]),
                _row("plain-compile", 0.3, own=1.2, repeat_seconds=[0.6, 0.5]),
            ],
        ),
        (point("bf16", head="objective"), [_row("objective-linear_ce", 0.3, own=1.09)]),
        (config.Point(8, 4, 32, "fp32", "cpu"), [_row("linear_ce", 2.0)]),
    ]
    found = {
        (t.name, t.dtype): (t.measured, t.bound, t.met) for t in targets.check(summaries, shape)
    }
    approx = pytest.approx
    assert found == {
        ("step (× its floor)", "fp32"): (1.04, 1.05, True),
        ("step × plain's (paired; below 1: faster)", "fp32"): (approx(2 / 3), 1.0, True),
        ("step × plain-compile's (paired; below 1: faster)", "fp32"): (approx(2 / 2.1), 1.0, True),
        ("step × torch-512's (paired; below 1: faster)", "fp32"): (approx(1.05), 1.0, False),
        ("step's transient memory (× grads)", "fp32"): (1.24, 1.5, True),
        ("forward only (× its floor)", "fp32"): (1.06, 1.05, False),
        ("step, 75% ignored, reduction=mean (× the unmasked step)", "fp32"): (0.29, 0.3, True),
        ("token_logprobs with entropy (× its four GEMMs)", "fp32"): (approx(1.0425), 1.05, True),
        ("linear_divergence (× floor-2heads)", "fp32"): (1.11, 1.1, False),
        ("step (× its floor)", "bf16"): (1.01, 1.05, True),
        # Quotients 0.83 and 1.2: their median (1.017) is not faster, though its
        # ratio to the floor is the lower.
        ("step × plain-compile's (paired; below 1: faster)", "bf16"): (approx(61 / 60), 1.0, False),
        ("token_objective (× its floor)", "bf16"): (1.09, 1.1, True),
    }


def test_bad_cli_values():
    from linear_ce.bench.__main__ import parse_args

    for argv in (
        ["--dtype", "int8"],
        ["--sweep", "Q=1"],
        ["--variants", "nope"],
        ["--repeats", "0"],
        ["--ignored", "1.5"],
        ["--heads", "ce,nope"],
        ["--reductions", "avg"],
        ["--extra-dtype", "int8"],
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert set(DEFAULT) <= set(VARIANTS)


def test_half_rows_have_a_paired_ratio_to_their_own_dtype_floor():
    """A bf16 training row is divided, round by round, by the fp32 floor and by the bf16
    floor of the same round; an fp32 row and a forward row get no second ratio."""
    from linear_ce.bench.report import summarize
    from linear_ce.bench.runner import Measured

    def measured(*seconds):
        return Measured(seconds=list(seconds), peak_bytes=[1])

    half = config.Point(8, 4, 16, "bf16", "cpu")
    rows = summarize(
        half,
        {
            "floor": measured(1.0, 2.0, 1.0),
            "floor-fp32": measured(2.0, 4.0, 3.0),
            "linear_ce": measured(1.1, 2.4, 1.3),
            "floor-fwd": measured(0.5, 0.5, 0.5),
            "linear_ce-fwd": measured(0.5, 0.6, 0.7),
        },
    )
    by_name = {row.variant: row for row in rows}
    assert by_name["linear_ce"].ratio == pytest.approx(0.55)  # median of 0.55, 0.6, 0.4333
    assert by_name["linear_ce"].own_ratio == pytest.approx(1.2)  # median of 1.1, 1.2, 1.3
    assert by_name["linear_ce-fwd"].own_ratio is None
    full = config.Point(8, 4, 16, "fp32", "cpu")
    rows = summarize(full, {"floor": measured(1.0), "linear_ce": measured(1.1)})
    assert rows[1].own_ratio is None and rows[1].ratio == pytest.approx(1.1)


def test_dpo_point_is_measured_against_the_gemms_of_its_scored_rows():
    """A DPO point's prompts (the first quarter of each 256-token sequence) are never
    scored: its floors are the three GEMMs on the other rows, and its rows' ratios are
    taken to them (fp32: ``floor-scored``; bf16: ``floor-scored-fp32`` and, as their own
    dtype's, ``floor-scored``); the all-rows floors are not measured there."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from linear_ce.bench.variants import make_inputs, measured_at, own_floor_variant
    from linear_ce.bench.variants import reference_variant as reference

    fp32 = config.Point(512, 8, 64, "fp32", "cpu", head="dpo")
    bf16 = config.Point(512, 8, 64, "bf16", "cpu", head="dpo")
    assert reference(fp32, "train") == "floor-scored"
    assert reference(bf16, "train") == "floor-scored-fp32"
    assert own_floor_variant(bf16, "train") == "floor-scored"
    assert not measured_at("floor", fp32) and not measured_at("floor-fp32", bf16)
    assert measured_at("floor", config.Point(512, 8, 64, "fp32", "cpu", head="sparse"))

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
                seen.append((tuple(args[0].shape), tuple(args[1].shape)))
            return func(*args, **(kwargs or {}))

    seen = []
    call = VARIANTS["floor-scored"].build(*make_inputs(fp32))
    with Shapes():
        call()
    # 2 sequences of 256 tokens, 64 of each a prompt: 384 scored rows.
    assert seen == [((384, 8), (8, 64)), ((384, 64), (64, 8)), ((64, 384), (384, 8))]
    assert VARIANTS["floor-scored"].unavailable(config.Point(300, 8, 64, "fp32", "cpu")) is not None


@pytest.mark.parametrize("form", ["exp", "exp2"])
def test_plan_note_says_how_half_math_forms_the_exponential(monkeypatch, form):
    """The note names ``Plan.exp2``'s choice where there is one (half inputs' fp32 math on
    a CPU), forced here by ``LINEAR_CE_EXP``; an fp32 plan has none to name."""
    from linear_ce import LinearCrossEntropyOptions
    from linear_ce.bench.variants import _plan_fields, plan_note
    from linear_ce.engine.machine import EXP_ENV
    from linear_ce.engine.plan import make_plan

    monkeypatch.setenv(EXP_ENV, form)

    def note(dtype):
        plan = make_plan(256, 32, 512, dtype, torch.device("cpu"), LinearCrossEntropyOptions())
        fields = _plan_fields(plan, 256)
        extra = {"fixed_rule": fields, "chunk_rates": {}, "half_speedup": None, "step_rates": {}}
        return plan_note({**fields, **extra})

    assert f", {form}," in note(torch.bfloat16)
    assert ", exp" not in note(torch.float32)


@pytest.mark.parametrize("mode", ["0", "1"])
def test_plan_note_says_which_row_loops_run(monkeypatch, mode):
    """The note names the row math an fp32 plan's heads take: the compiled loops
    (``LINEAR_CE_NATIVE_ROWS=1``) or torch's operations (``0``)."""
    from linear_ce import LinearCrossEntropyOptions
    from linear_ce.bench.variants import _plan_fields, plan_note
    from linear_ce.engine.native_rows import NATIVE_ROWS_ENV
    from linear_ce.engine.plan import make_plan

    if mode == "1" and shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the compiled row loops cannot build")
    monkeypatch.setenv(NATIVE_ROWS_ENV, mode)
    plan = make_plan(256, 32, 512, torch.float32, torch.device("cpu"), LinearCrossEntropyOptions())
    fields = _plan_fields(plan, 256)
    extra = {"fixed_rule": fields, "chunk_rates": {}, "half_speedup": None, "step_rates": {}}
    loops = "compiled" if mode == "1" else "torch"
    assert plan_note({**fields, **extra}).endswith(f", {loops} row loops")


def test_worker_plan_names_the_kept_scratch(monkeypatch):
    """The worker's plan answer, asked after the warm-up call, holds the scratch kept
    between calls, and the table's note says it."""
    import io

    from linear_ce.bench.variants import plan_note
    from linear_ce.bench.worker import serve
    from linear_ce.engine import scratch

    monkeypatch.setattr(scratch, "MIN_KEPT_BYTES", 0)
    scratch.release()
    point = {"N": 64, "D": 16, "V": 4096, "dtype": "fp32", "device": "cpu"}
    commands = [{"op": "setup", "point": point}, {"op": "run"}, {"op": "plan"}, {"op": "exit"}]
    out = io.StringIO()
    serve("linear_ce", [json.dumps(c) for c in commands], out)
    plan = json.loads(out.getvalue().splitlines()[2])["plan"]
    kept = scratch.kept_bytes()
    scratch.release()
    assert kept > 0 and plan["kept_scratch_bytes"] == kept
    assert plan_note(plan).endswith(f"; {kept / 2**20:.0f} MiB scratch kept between calls")


@pytest.mark.parametrize(
    ("variant", "head", "outs"),
    [("floor", "ce", 1), ("floor-fwd", "ce", 1), ("floor-2heads", "divergence", 2)],
)
def test_floors_write_their_logits_into_one_buffer(variant, head, outs):
    """A floor's logits GEMMs write into buffers made when it is built, the same ones on
    every call (a fresh ``(N, V)`` result would fault its pages in each time, work the
    GEMMs do not need), and what they hold is the logits, against float64."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from linear_ce.bench.variants import make_inputs

    class Outs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.out:
                seen.append((kwargs["out"].data_ptr(), args[0], args[1], kwargs["out"]))
            return result

    x, w, t = make_inputs(config.Point(64, 8, 48, "fp32", "cpu", head=head))
    call = VARIANTS[variant].build(x, w, t)
    calls = []
    for _ in range(2):
        seen = []
        with Outs():
            call()
        calls.append(seen)
    assert len(calls[0]) == outs
    assert [ptr for ptr, *_ in calls[0]] == [ptr for ptr, *_ in calls[1]]
    for _, a, b, out in calls[1]:
        expected = a.double() @ b.double()
        # The bound: 3 eps(fp32), or twice the plain fp32 product's own error.
        plain_error = ((a @ b).double() - expected).norm() / expected.norm()
        bound = max(3 * torch.finfo(torch.float32).eps, 2 * plain_error.item())
        assert (out.double() - expected).norm() / expected.norm() <= bound


def test_report_names_the_cpu_family_and_model():
    """Two CPUs with the same model name and flags ("AMD EPYC", a Zen 4 and a Zen 5 under a
    hypervisor) are told apart by family, model and L3 size, read from /proc/cpuinfo's first
    CPU; the title line shows them; a file without them gives ``None``."""
    from linear_ce.bench.__main__ import _title
    from linear_ce.bench.report import cpu_identity

    cpuinfo = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
        "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n"
    )
    assert cpu_identity(cpuinfo, 32 << 20) == "family 26, model 2, L3 32 MiB"
    assert cpu_identity(cpuinfo, None) == "family 26, model 2"
    assert cpu_identity("processor\t: 0\nmodel name\t: Neoverse\n", None) is None
    info = {"cpu": "AMD EPYC", "cpu_identity": "family 26, model 2, L3 32768K", "cores": 2}
    title = _title({"machine": {**info, "torch": "2.13.0"}, "device": "cpu", "repeats": 3})
    assert title.startswith("AMD EPYC (family 26, model 2, L3 32768K), 2 cores, torch 2.13.0")


def test_progress_lines_on_a_pipe_and_the_in_process_run(tmp_path):
    """Outside a terminal each finished point is a line with the time elapsed and left; an
    in-process run measures every point again, its ratios in their own column and JSON
    list, and the targets read them."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "linear_ce.bench",
            *("--shapes", "32,16,64", "--dtype", "fp32", "--sweep", "none", "--ignored", "none"),
            *("--variants", "floor,plain,linear_ce", "--repeats", "2", "--in-process"),
            *("--json", str(out), "--plot", str(tmp_path / "bench.png")),
        ],
        capture_output=True,  # stdout a pipe: the per-point lines
        text=True,
        timeout=600,
        env={**os.environ, "LINEAR_CE_MEASURE": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == ["[1/2", "[2/2"], proc.stdout
    assert "N=32 D=16 V=64 fp32; linear_ce " in lines[0] and "elapsed" in lines[0]
    assert lines[0].endswith(" left") and "in-process" in lines[1]
    assert "in-process" in proc.stdout.split("┃ note")[0]
    assert "Targets at N=32 D=16 V=64, this run, in-process" in proc.stdout
    data = json.loads(out.read_text())
    assert data["in_process"] is True
    (point,) = data["in_process_points"]
    rows = {row["variant"]: row for row in point["rows"]}
    assert [len(rows[name]["repeat_seconds"]) for name in ("floor", "plain", "linear_ce")] == [
        2,
        2,
        2,
    ]
    step = next(t for t in data["targets"] if t["name"] == "step (× its floor)")
    assert step["measured"] == pytest.approx(rows["linear_ce"]["ratio"])


def test_in_process_run_puts_a_model_step_before_every_call(monkeypatch):
    """Each call (warm-up and repeats) follows one step of the model, in this process, the
    rounds interleaved; the block's step itself trains (gradients reach its weights)."""
    from linear_ce.bench import runner, workload

    point = config.Point(64, 64, 96, "fp32", "cpu")
    block_step = workload.model_step(point)
    block_step()
    order = []

    def model_step(at):
        assert at == point

        def step():
            order.append("model")

        return step

    monkeypatch.setattr(workload, "model_step", model_step)
    calls = []
    import linear_ce.bench.measure as measure_module

    real = measure_module.measure

    def measure(call, device):
        calls.append(call)
        order.append("call")
        return real(call, device)

    monkeypatch.setattr(measure_module, "measure", measure)
    (measured,) = runner.run_points_in_process(
        [point], ["floor", "linear_ce", "floor-fwd"], 3, lambda text, n: None
    )
    assert order == ["model", "call"] * 12
    assert {name: len(m.seconds) for name, m in measured.items()} == {
        "floor": 3,
        "linear_ce": 3,
        "floor-fwd": 3,
    }
    # Round r starts at variant r: the timed calls' order rotates.
    firsts = [calls[3 + 3 * r] for r in range(3)]
    assert len({id(c) for c in firsts}) == 3
    assert measured["linear_ce"].plan is not None


def _slow_bf16(monkeypatch, half=0.5, single=100.0):
    from linear_ce.bench import runner, variants

    monkeypatch.setattr(variants, "half_gemm_rates", lambda dtype, features: (half, single))
    monkeypatch.setattr(runner, "half_gemm_rates", lambda dtype, features: (half, single))


def test_slow_half_peers_are_measured_at_fewer_rows_and_scaled(monkeypatch):
    """Where bf16 GEMMs run far below fp32's, a peer doing its GEMMs in bf16 gets as many
    rows as fit the time cap, its seconds scale to the point's rows, it has no memory and
    the note says why; linear_ce and the fp32 floor keep every row; a variant that cannot
    take fewer rows (DPO: whole pairs of sequences) is not measured, with the reason."""
    from linear_ce.bench import runner
    from linear_ce.bench.report import summarize

    _slow_bf16(monkeypatch)
    point = config.Point(2048, 1024, 32768, "bf16", "cpu")
    per_row = 6 * 1024 * 32768 / 0.5e9 * 4  # seconds a row costs over the 4 calls
    assert runner.reduced_rows(point, "plain", 3) == int(runner.SLOW_PEER_SECONDS / per_row)
    assert runner.reduced_rows(point, "linear_ce", 3) is None
    assert runner.reduced_rows(point, "floor-fp32", 3) is None
    assert runner.reduced_rows(dataclasses.replace(point, dtype="fp32"), "plain", 3) is None
    _slow_bf16(monkeypatch, half=60.0)
    assert runner.reduced_rows(point, "plain", 3) is None  # not slow: within 4x of fp32
    _slow_bf16(monkeypatch, half=1e-3)
    assert runner.reduced_rows(point, "plain", 3) == 1

    measured = runner.Measured()
    dpo = config.Point(2048, 1024, 32768, "bf16", "cpu", head="dpo")
    assert runner._reduce(dpo, "dpo-plain", 3, measured) is None
    assert measured.unavailable.startswith("not measured: its bf16 GEMMs run at")

    _slow_bf16(monkeypatch)
    plain = runner.Measured()
    reduced = runner._reduce(point, "plain", 3, plain)
    assert plain.rows == reduced.N
    plain.record(point, {"seconds": 2.0, "peak_bytes": 7})
    assert plain.seconds == [2.0 * 2048 / plain.rows] and plain.peak_bytes == []
    floor = runner.Measured(seconds=[1.0], peak_bytes=[5])
    (_, row) = summarize(point, {"floor-fp32": floor, "plain": plain})
    assert row.ratio == pytest.approx(2.0 * 2048 / plain.rows)
    assert row.peak_bytes is None and row.peak_ratio is None
    assert row.note.startswith(f"measured at N={plain.rows}, time scaled to N=2048: its bf16")


def test_half_rows_own_ratio_reads_the_faster_floor_each_round():
    """A half row's second ratio is to the faster of its own-dtype floor and the fp32
    floor, round by round (the upcast floor where the half GEMMs are slower)."""
    from linear_ce.bench.report import summarize
    from linear_ce.bench.runner import Measured

    def measured(*seconds):
        return Measured(seconds=list(seconds), peak_bytes=[1])

    half = config.Point(8, 4, 16, "bf16", "cpu")
    rows = summarize(
        half,
        {
            "floor": measured(2.0, 0.5),
            "floor-fp32": measured(1.0, 1.0),
            "linear_ce": measured(1.1, 0.6),
        },
    )
    ours = rows[-1]
    assert ours.own_ratio == pytest.approx((1.1 / 1.0 + 0.6 / 0.5) / 2)
    assert ours.ratio == pytest.approx((1.1 + 0.6) / 2)


def test_a_peer_without_memory_is_drawn_in_time_only():
    """A peer measured at fewer rows has a time and no memory: its time is drawn, bar or
    line, and its memory left out."""
    import matplotlib.pyplot as plt

    from linear_ce.bench import report

    def row(variant, ratio, peak_ratio):
        return report.Row(variant, "train", "floor", 1.0, ratio, None, peak_ratio, "")

    summaries = [
        (config.Point(8, 4, 16, "fp32", "cpu"), [row("plain", 2.0, None), row("floor", 1.0, 2.0)]),
        (config.Point(8, 4, 32, "fp32", "cpu"), [row("plain", 3.0, None), row("floor", 1.0, 2.5)]),
        (config.Point(8, 4, 16, "bf16", "cpu"), [row("plain", 300.0, None), row("floor", 1, 2)]),
    ]
    fig = report.plot(summaries, "V", "title")
    time_fp32, time_bf16, memory_fp32, memory_bf16 = fig.axes
    assert {line.get_label(): list(line.get_ydata()) for line in time_fp32.get_lines()} == {
        "floor": [1.0, 1.0],
        "plain": [2.0, 3.0],
    }
    assert {line.get_label(): list(line.get_ydata()) for line in memory_fp32.get_lines()} == {
        "floor": [2.0, 2.5],
        "plain": [],
    }
    assert [bar.get_height() for bar in time_bf16.patches] == [300.0, 1]
    assert [bar.get_height() for bar in memory_bf16.patches] == [2]
    plt.close(fig)
