"""Time from a first Ctrl-C (SIGINT to the process group, as a terminal sends it) to rank 0's
line, and to the exit, for `python mingpt_ddp/main.py` and `mingpt-torchrun --nproc_per_node=2`."""
import os, signal, subprocess, sys, tempfile, time
from pathlib import Path

repo = Path(os.environ["REPO"])
py = sys.executable
corpus = Path(tempfile.mkdtemp()) / "small.txt"
corpus.write_text(Path(os.environ.get("DATA", repo / "tests/data/tinyshakespeare-40k.txt")).read_text()[:40_000])
TINY = ["model=gpt-nano", "data.block_size=32", "trainer.batch_size=8", "trainer.max_epochs=1000",
        f"data.path={corpus}", "trainer.compile=false"]
LINE = "Ctrl-C: stopping"
launchers = [[py], [py, "-m", "mingpt_ddp.torchrun", "--standalone", "--nproc_per_node=2"]]
for launcher in launchers[:int(os.environ.get("LAUNCHERS", "2"))]:
    for extra in ([], ["trainer.stop_check_seconds=20", "trainer.log_every=100000"]):
        d = Path(tempfile.mkdtemp())
        log = d / "out.log"
        with open(log, "wb") as out:
            p = subprocess.Popen([*launcher, str(repo / "mingpt_ddp/main.py"), *TINY, *extra, f"hydra.run.dir={d}/run"],
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=d,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(repo)})
        while "steps planned" not in log.read_text() and p.poll() is None:
            time.sleep(0.05)
        time.sleep(3)
        os.killpg(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        said = None
        while p.poll() is None:
            if said is None and LINE in log.read_text():
                said = time.monotonic() - t0
            time.sleep(0.01)
        ended = time.monotonic() - t0
        text = log.read_text()
        if said is None and LINE in text:
            said = ended
        snaps = sorted(x.name for x in (d / "run").glob("snapshot.step*.pt"))
        name = "torchrun x2" if len(launcher) > 1 else "python"
        print(f"{name:12s} {' '.join(extra) or 'defaults':55s} line after "
              f"{'never' if said is None else f'{said:.2f} s'}, exit {p.returncode} after {ended:.2f} s, "
              f"newest snapshot {snaps[-1] if snaps else None}", flush=True)
        if os.environ.get("SHOW"):
            print(text[-2500:])
