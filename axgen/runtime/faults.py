"""What keeps a run safe: stop signals honoured at a step boundary on every process, non-finite steps counted,
and one run at a time per run directory."""

import contextlib
import fcntl
import os
import signal
import socket
import tempfile

import jax

from axgen.runtime.checkpoints import any_process


class StopSignals:
    """SIGTERM (a preemption notice) or SIGINT asks the run to stop: every process finishes the same step, the run
    saves a checkpoint there and exits 0. A second signal stops the process at once."""

    def __init__(self, mesh):
        self.mesh, self.received, self.pending = mesh, None, None

    def __enter__(self):
        self.previous = {
            signum: signal.signal(signum, self.handle) for signum in (signal.SIGTERM, signal.SIGINT)
        }
        return self

    def __exit__(self, *exception):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def handle(self, signum, frame):
        if self.received is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signal.Signals(signum).name
        print(
            f"{self.received}: stopping with a checkpoint after this step (again: stop at once)", flush=True
        )

    def requested(self, state):
        """Whether every process stops after the step that made `state`; each process calls it once per step.
        Processes agree through `any_process`, read a step late so no host waits on the step it just dispatched.
        """
        if jax.process_count() == 1:
            return self.received is not None
        if jax.devices()[0].platform == "cpu":
            # CPU devices run programs side by side, not in turn: two programs' collectives could wait on each other.
            jax.block_until_ready(state)
            return bool(jax.device_get(any_process(self.mesh, self.received is not None)))
        previous, self.pending = self.pending, any_process(self.mesh, self.received is not None)
        return previous is not None and bool(jax.device_get(previous))


class NonFiniteGuard:
    """Counts the steps train_step skipped for a non-finite loss or gradient norm, and stops the run after
    `limit` in a row; the params are then the last good step's, as is every checkpoint saved since. Each step's
    flag is read one step late, so the host never waits on the step it has just dispatched."""

    def __init__(self, limit):
        self.limit, self.in_a_row, self.skipped, self.pending = limit, 0, 0, None

    def after(self, step, skipped):
        previous, self.pending = self.pending, (step, skipped)
        if previous is not None:
            self._count(*previous)

    def finish(self):
        if self.pending is not None:
            self._count(*self.pending)
            self.pending = None

    def _count(self, step, skipped):
        if not bool(skipped):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.skipped += 1
        print(
            f"step {step}: loss or gradient norm not finite; skipped ({self.in_a_row} in a row)", flush=True
        )
        if self.in_a_row >= self.limit:
            raise SystemExit(
                f"error: {self.in_a_row} steps in a row up to step {step} had a non-finite loss or gradient norm"
                " (--max-bad-steps); the params are the last good step's"
            )


class RunDirError(ValueError):
    """A --run-dir that cannot be a folder; the message names it."""


def make_run_dir(run_dir) -> list[str]:
    """Creates RUN_DIR and the folders above it that are missing; returns those it created, deepest first."""
    created, path = [], os.path.abspath(run_dir)
    while not os.path.lexists(path):
        created.append(path)
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise RunDirError(f"--run-dir {run_dir}: {path} is not a directory")
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as err:  # what no check can tell beforehand: root may write anywhere, but not under /proc
        raise RunDirError(f"--run-dir {run_dir}: cannot create {err.filename}: {err.strerror}") from None
    if not created:
        # A folder this run did not make may refuse files (another user's, a read-only mount, /proc even to
        # root, where os.access says yes): a file made and dropped at once finds out before jax starts.
        try:
            with tempfile.TemporaryFile(dir=run_dir):
                pass
        except OSError as err:
            raise RunDirError(f"--run-dir {run_dir}: cannot write a file into it ({err.strerror})") from None
    return created


@contextlib.contextmanager
def lock_run_dir(run_dir, created=()):
    """Holds RUN_DIR/.lock while the context is open, so a second run on the same directory is refused, naming
    this one; the kernel drops the lock of a process that dies. Process 0 holds it for the whole job.

    A run that fails (a wrong --init-from, a model too big) removes the lock file if it made it, and those of
    the folders it made (`created`, deepest first) that are still empty: a run dir is left as the run found
    it, with anything the run wrote. It does so before it lets go of the lock, so never under another run."""
    if jax.process_index() != 0:
        yield
        return
    path = os.path.join(run_dir, ".lock")
    made = not os.path.lexists(path)
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise SystemExit(f"error: {run_dir} is in use by another run ({lock.read().strip()})")
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        try:
            yield
        except BaseException:
            if made:
                os.unlink(path)
            for folder in created:
                with contextlib.suppress(OSError):  # not empty: it holds what the run wrote
                    os.rmdir(folder)
            raise
