from pathlib import Path

import pytest

from helpers import torchrun

# the parts of tests/integration/two_processes.py on a loaded machine take 3 to 4 minutes together
TWO_PROCESSES_TIMEOUT_S = 1200
# the part of the launch each test file reads
TWO_PROCESS_PARTS = {"test_fsdp.py": "fsdp", "test_distributed.py": "ddp", "test_signals.py": "stop"}


@pytest.fixture(scope="session")
def two_processes(request, tmp_path_factory):
    """The folder and the process of the session's one two-process torchrun launch of the model code
    (tests/integration/two_processes.py): each part's files are in the folder of its name (fsdp, ddp, stop). The
    launch runs the parts the session's selected tests read (a run of one test file pays for its own part only)."""
    parts = {TWO_PROCESS_PARTS[item.path.name] for item in request.session.items
             if "two_processes" in getattr(item, "fixturenames", ())}
    out = tmp_path_factory.mktemp("two-processes")
    worker = Path(__file__).resolve().parent / "two_processes.py"
    return out, torchrun(str(worker), str(out), *sorted(parts), timeout=TWO_PROCESSES_TIMEOUT_S)
