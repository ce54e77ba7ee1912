import os, signal, pytest
pytestmark = pytest.mark.component
from tests.slurm_support import PROLOG, EPILOG, SLURM_ENV, run_script
from tests.agentd_support import AgentProc

@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_restart(base, adloader_bin, how):
    a = AgentProc(base).start()
    env = {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": a.endpoint, "SLURM_JOB_UID": str(os.getuid())}
    rc, out, err, wall = run_script(PROLOG, env); print(err)
    print(a.job("4242"))
    a.stop(how)
    rc, out, err, wall = run_script(EPILOG, env); print("down:", err)
    a2 = AgentProc(base).start()
    print(a2.job("4242"))
    rc, out, err, wall = run_script(EPILOG, env); print(err)
    rc, out, err, wall = run_script(EPILOG, env); print(err)
    rc, out, err, wall = run_script(EPILOG, {**env, "SLURM_JOB_ID": "999"}); print(err)
    rc, out, err, wall = run_script(PROLOG, {**env, "SLURM_JOB_UID": "4294967295"}); print(err)
    rc, out, err, wall = run_script(PROLOG, {**env, "SLURM_JOB_ID": "9" * 128}); print(err)
    a2.stop()
