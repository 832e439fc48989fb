"""Plain loops and Lightning Fabric: GradientMonitor, GradientLog and save_on_disk give what the
callback gives (statistics, histograms, update ratios, the flow picture, the report), and such a
loop never imports Lightning."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from lightning_gradhooks import GradientLog, GradientMonitor, save_on_disk

from conftest import read_events

#: The loop of docs/plain-loops.md, run verbatim below.
LOOP = """
monitor = GradientMonitor(model)
log = GradientLog(writer, optimizers=[optimizer])   # writer: a torch SummaryWriter
with monitor.attach():
    for step, batch in enumerate(loader):
        if step % 50 == 0:
            monitor.arm()
        loss_fn(model(batch)).backward()
        log.write(monitor.collect(), step)          # before optimizer.step(): the update ratio is measured
        optimizer.step(); optimizer.zero_grad()
report = log.close()                                # prints the report, writes it to the Text tab, returns it
"""


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def batches(n: int = 120) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(n)]


def run_loop(net: nn.Module, optimizer, loader, log_dir) -> dict:  # noqa: ANN001
    namespace = {"GradientMonitor": GradientMonitor, "GradientLog": GradientLog, "model": net,
                 "optimizer": optimizer, "loader": loader, "loss_fn": lambda out: out.square().mean(),
                 "writer": SummaryWriter(log_dir)}
    exec(LOOP, namespace)  # noqa: S102 - the documented loop, verbatim
    namespace["writer"].close()
    return namespace


def check_events(log_dir, steps: list[int]) -> None:  # noqa: ANN001
    events = read_events(str(log_dir))
    tags = events.Tags()
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/2")] == steps
    assert [e.step for e in events.Scalars("∇4 param_grad_norm/0.weight")] == steps
    assert [e.step for e in events.Scalars("∇5 param_update_ratio/0.weight")] == steps
    assert "∇6 histograms/grad_output/0" in tags["histograms"] and "∇1 overview/gradient_flow" in tags["images"]
    assert "gradhooks/health_report/text_summary" in tags["tensors"]


def test_the_documented_loop_runs_verbatim_in_plain_pytorch(tmp_path, capsys):
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    done = run_loop(net, optimizer, batches(), tmp_path)
    report = done["report"]
    assert report.steps == 3 and report.flags() == []
    assert "no gradient problems seen in 3 logged steps" in capsys.readouterr().out
    check_events(tmp_path, [0, 50, 100])
    # Nothing of ours is left on the optimizer.
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_steps_go_to_an_event_file_of_ours_checked_by_tensorboards_reader_and_its_writer_is_untouched(tmp_path):
    """The logged steps are written to our own event file beside the writer's, checksummed with
    google-crc32c's C code; TensorBoard's writer (its pure-Python checksum) is not replaced, and
    every record of both files passes TensorBoard's own reader."""
    import glob

    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New, masked_crc32c
    from tensorboard.summary.writer import record_writer

    from lightning_gradhooks.summary.events import masked_crc32c as our_crc32c

    for data in (b"", b"\x00", os.urandom(1000), os.urandom(100_003)):
        assert our_crc32c(data) == masked_crc32c(data)
    net = model()
    run_loop(net, torch.optim.SGD(net.parameters(), lr=0.1), batches(), tmp_path)
    assert record_writer.masked_crc32c is masked_crc32c  # TensorBoard's own, as imported
    ours = glob.glob(str(tmp_path / "events.out.tfevents.*.gradhooks"))
    assert len(ours) == 1 and len(glob.glob(str(tmp_path / "events.out.tfevents.*"))) == 2
    for path in glob.glob(str(tmp_path / "events.out.tfevents.*")):
        reader, records = PyRecordReader_New(path), 0
        with pytest.raises(errors.OutOfRangeError):  # the end of the file, after every record passed
            while True:
                reader.GetNext()  # raises DataLossError on a wrong checksum
                records += 1
        assert records >= 3  # the file version, then the logged steps (ours) or the rest (the writer's)
    check_events(tmp_path, [0, 50, 100])  # TensorBoard reads both files as one run


def test_the_documented_loop_runs_verbatim_in_lightning_fabric(tmp_path):
    fabric_module = pytest.importorskip("lightning.fabric")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    net = model()
    wrapped, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    # The wrapped module is monitored under the model's own names.
    done = run_loop(wrapped, optimizer, batches(60), tmp_path)
    assert done["report"].steps == 2
    check_events(tmp_path, [0, 50])


def test_under_a_gradient_scaler_the_log_gets_unscaled_gradients_in_fabric_and_plain_loops(tmp_path):
    """Before `scaler.unscale_(optimizer)` (Fabric's `optimizer.step()` unscales inside, as a
    fused optimizer does) the parameter gradients are scaled too: `unscaled(scale,
    parameters=True)` divides them, and the log equals that of the same loop without a scaler."""
    fabric_module = pytest.importorskip("lightning.fabric")
    from lightning.fabric.plugins.precision import MixedPrecision

    def loop(wrapped, optimizer, scaler, log_dir, unscale_first=False):  # noqa: ANN001
        monitor, writer = GradientMonitor(wrapped), SummaryWriter(log_dir)
        log = GradientLog(writer, optimizers=[optimizer], echo=None)
        with monitor.attach():
            for step, batch in enumerate(batches(3)):
                monitor.arm()
                loss = wrapped(batch).float().square().mean()
                if scaler is None:
                    loss.backward()
                    log.write(monitor.collect(), step)
                elif unscale_first:  # a plain loop that unscales (to clip, say) before the log
                    scaler.scale(loss).backward()
                    scaler.unscale_(optimizer)
                    log.write(monitor.collect().unscaled(scaler.get_scale()), step)
                else:
                    fabric.backward(loss)
                    log.write(monitor.collect().unscaled(scaler.get_scale(), parameters=True), step)
                (scaler.step(optimizer), scaler.update()) if unscale_first else optimizer.step()
                optimizer.zero_grad()
        log.close()
        writer.close()
        events = read_events(str(log_dir))
        return {(t, e.step): e.value for t in events.Tags()["scalars"] if t.startswith(("∇4", "∇2"))
                for e in events.Scalars(t)}

    net = model()
    reference = loop(net, torch.optim.Adam(net.parameters(), lr=1e-3), None, tmp_path / "fp32")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    net = model()
    wrapped, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3, fused=True))
    scaled = loop(wrapped, optimizer, scaler, tmp_path / "fabric")
    net = model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    plain = loop(net, torch.optim.Adam(net.parameters(), lr=1e-3), scaler, tmp_path / "plain", unscale_first=True)
    assert len(reference) == 3 * 6 and set(scaled) == set(plain) == set(reference)
    for key, value in reference.items():
        assert scaled[key] == pytest.approx(value, rel=1e-2), key
        assert plain[key] == pytest.approx(value, rel=1e-5), key


def test_a_plain_loop_never_imports_lightning(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        import torch
        from torch.utils.tensorboard import SummaryWriter
        from lightning_gradhooks import GradientLog, GradientMonitor
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = [torch.randn(4, 8) for _ in range(3)]
        loss_fn = lambda out: out.square().mean()
        writer = SummaryWriter({str(tmp_path)!r})
        """) + LOOP + textwrap.dedent("""
        lightning = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
        assert not lightning, lightning
        print("steps", report.steps)
        """)
    # torch's own switch, which the statistics honour (eager ops): a process would compile its own
    # kernels, and test_compile.py and test_stats.py are where the compiled ones are tested.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TORCH_COMPILE_DISABLE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "steps 1" in done.stdout


def test_offload_in_a_plain_loop_leaves_nothing(tmp_path):
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    (tmp_path / "off").mkdir()
    offload = save_on_disk(threshold_bytes=1024, directory=tmp_path / "off")
    try:
        for x in batches(4):
            with offload:
                loss = net(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        offload.close()
    assert offload.stats().bytes_offloaded > 0 and os.listdir(tmp_path / "off") == []


def test_log_arguments_are_checked_and_a_second_close_is_a_no_op(tmp_path):
    with pytest.raises(ValueError, match="`writer` expected a SummaryWriter"):
        GradientLog(writer=42)
    with pytest.raises(ValueError, match="`statistics` expected a list drawn from"):
        GradientLog(statistics=["norm", "speed"])
    log = GradientLog(echo=None)
    report = log.close()
    assert report is not None and log.close() is report  # the second close returns the same report
    with pytest.raises(RuntimeError, match="closed"):
        log.write(GradientMonitor(model()).collect(), 0)


#: The fp16 loop of docs/mixed-precision.md ("Skipped steps"), run verbatim below.
LOOP_FP16 = """
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)   # "cuda" on a GPU; starts too high
monitor = GradientMonitor(model)
log = GradientLog(writer, optimizers=[optimizer], precision=torch.float16)
with monitor.attach():
    for step, batch in enumerate(loader):
        logged = step % 2 == 0
        if logged:
            monitor.arm()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(batch))
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        log.write(monitor.collect().unscaled(scale, parameters=True), step, scalars={"loss_scale": scale})
        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()
        if logged:                                  # a lower scale: the scaler skipped the step
            log.write_scaler(step, scale, scaler.get_scale())
report = log.close()
"""


def test_a_plain_loop_tells_the_log_what_its_scaler_skipped(tmp_path, capsys):
    """A scaler that starts at 2^40 skips its first steps: counted in one note, no flag, and the
    report command reads the same from the event files."""
    from lightning_gradhooks.__main__ import main

    net = model()
    namespace = {"GradientMonitor": GradientMonitor, "GradientLog": GradientLog, "torch": torch, "model": net,
                 "optimizer": torch.optim.Adam(net.parameters(), lr=1e-3), "loader": batches(60),
                 "loss_fn": lambda out: out.float().square().mean(), "writer": SummaryWriter(str(tmp_path))}
    exec(LOOP_FP16, namespace)  # noqa: S102 - the documented loop, verbatim
    namespace["writer"].close()
    report = namespace["report"]
    text = report.table()
    assert report.rows() == [] and report.names() == set(), text
    assert text.splitlines()[1].startswith("note: the gradient scaler skipped 11 of 30 logged steps")
    assert text.splitlines()[1].endswith("its scale went from 2^40 to 2^18")
    events = read_events(str(tmp_path))
    assert [e.value for e in events.Scalars("∇1 overview/scaler_skipped")][:3] == [1.0, 1.0, 1.0]
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--fail-on", "nonfinite"]) == 0  # a note fails nothing
    assert capsys.readouterr().out.split("\n", 1)[1].startswith(text + "\n")
    docs = (Path(__file__).parents[2] / "docs" / "mixed-precision.md").read_text()
    assert textwrap.indent(LOOP_FP16.strip(), "  ") in docs  # the loop shown is the loop run
    log = GradientLog(None, echo=None)
    with pytest.raises(ValueError, match="`scale` expected a finite number >= 0, got nan"):
        log.write_scaler(0, float("nan"), 1.0)
