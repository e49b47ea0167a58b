"""A command leaves without the interpreter's teardown, but with what an exit owes: its status,
its exit handlers, its buffered output, and the threads it still waits for."""

import subprocess
import sys

# A command's last line, `exit_command(status)`, in a process of its own. An object held in a
# module's globals says when the interpreter tears the modules down.
ENDING = """
import atexit, sys, threading, time
from jaxtron.errors import exit_command

class Teardown:
    def __del__(self):
        print("torn down", flush=True)

held = Teardown()
atexit.register(lambda: print("handler ran", end=" "))
if sys.argv[2] == "thread":
    def finish():
        time.sleep(0.3)
        print("thread finished", end=" ")
    threading.Thread(target=finish).start()
print("buffered", end=" ")  # still in stdout's buffer: a pipe is not a terminal
exit_command(int(sys.argv[1]))
"""


def ended(status: int, thread: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENDING, str(status),
                           "thread" if thread else "none"],
                          capture_output=True, text=True, timeout=60)


def test_a_finished_command_keeps_its_status_handlers_and_output_and_skips_the_teardown():
    for status in (0, 2):
        result = ended(status, thread=False)
        assert result.returncode == status
        assert result.stdout == "buffered handler ran ", result.stdout


def test_a_thread_still_running_is_waited_for_as_the_interpreter_would():
    result = ended(0, thread=True)
    assert result.returncode == 0
    assert "buffered" in result.stdout and "thread finished" in result.stdout
    assert "handler ran" in result.stdout
