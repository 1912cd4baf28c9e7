"""Run mingpt_ddp/main.py with a real load spike (3 busy processes on the cores) during exactly
the bf16 passes of trainer.precision=auto's first decision: the user's scenario, reproducibly.
The busy processes spin only while a flag file exists; the probe's passes end with
model.zero_grad (after their timing), which turns the spike on before each bf16 pass and off
after it (with 30 ms for the processes to take or leave the cores, outside the timed passes)."""
import atexit, os, runpy, subprocess, sys, tempfile, threading, time

flag = os.path.join(tempfile.mkdtemp(), "spike")
loop = ("import os, time\n"
        "end = time.time() + 100\n"  # never outlives a killed run by long
        f"while os.path.exists({flag!r} + '.run') and time.time() < end:\n"
        f"    if os.path.exists({flag!r}):\n"
        "        for _ in range(50000): pass\n"
        "    else:\n"
        "        time.sleep(0.002)\n")
open(flag + ".run", "w").close()
busy = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(int(os.environ.get("SPIKE_PROCS", "3")))]

from mingpt_ddp.model import GPT  # noqa: E402

passes = [0]
first_pass = []
original = GPT.zero_grad


def zero_grad(self, set_to_none=True):
    original(self, set_to_none=set_to_none)
    n = passes[0]
    passes[0] += 1
    first_pass.append(time.monotonic())
    if n == 0:  # whatever the probe does, the spike ends 3 s after its first pass
        timer = threading.Timer(3.0, lambda: os.path.exists(flag) and os.remove(flag))
        timer.daemon = True
        timer.start()
    if n < 6 and first_pass[-1] - first_pass[0] < 3.0:  # the first decision's passes: fp32, bf16, fp32, bf16, ...
        if n % 2 == 0 and n < 5:
            open(flag, "w").close()  # the next pass is bf16's: the spike starts
        elif os.path.exists(flag):
            os.remove(flag)
        time.sleep(0.03)


def stop_busy():
    for path in (flag, flag + ".run"):
        if os.path.exists(path):
            os.remove(path)
    for p in busy:
        p.wait(timeout=5)


atexit.register(stop_busy)  # main.py ends with os._exit after the atexit handlers
GPT.zero_grad = zero_grad
sys.argv = ["main.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.getcwd(), "mingpt_ddp", "main.py"), run_name="__main__")
