"""The fake GPU worker, except FAKE_MODE=hang: N progress reports at once, then a hang (a kernel that hangs
mid-sampling after reporting progress), or with CRASH_AFTER_S a crash that long after the reports (a kernel
that faults mid-sampling). Used by test_pycuda_measurer and test_measure_accounting."""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fake_gpu_worker as fake

from forecaster_mcp.measure.worker_protocol import Progress

_run = fake.FakeSession.run


def run(self, job, send):  # type: ignore[no-untyped-def]
    defines = json.loads(Path(job.kernel.cubin_path).read_text())["defines"]
    if defines.get("FAKE_MODE") == "hang":
        for i in range(int(defines.get("N", 8))):
            send(Progress(job_id=job.job_id, done=i, total=100.0, message=f"{i} timed runs"))
        if "CRASH_AFTER_S" in defines:
            time.sleep(float(defines["CRASH_AFTER_S"]))
            os.kill(os.getpid(), signal.SIGSEGV)
        fake._hang_forever()
    return _run(self, job, send)


fake.FakeSession.run = run  # type: ignore[method-assign]
if __name__ == "__main__":
    sys.exit(fake.main(sys.argv[1:]))
