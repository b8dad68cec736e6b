"""How torch's CPU threads wait (fp8train/train/threads.py): passive unless the user chose, set
in the environment torch will read. Measured under a competing process:
tests/e2e/test_cpu_threads.py."""
import pytest

from fp8train.train import threads


def test_the_policy_is_passive_unless_the_user_chose_one(tmp_path):
    env = {}
    assert threads.apply(env, dev=str(tmp_path)) == "OMP_WAIT_POLICY=passive" and env == {
        "OMP_WAIT_POLICY": "passive"}


def test_a_machine_with_a_gpu_visible_keeps_libgomps_default(tmp_path):
    """A GPU run's host threads are not what the policy was measured on: left as they are. A
    GPU hidden by CUDA_VISIBLE_DEVICES (empty or -1) is a CPU run. The device files are
    stand-ins in a folder of the test's own: no GPU here."""
    (tmp_path / "nvidiactl").touch()
    env = {}
    assert threads.apply(env, dev=str(tmp_path)) == "OMP_WAIT_POLICY=passive"   # no nvidiaN
    (tmp_path / "nvidia0").touch()
    env = {}
    assert threads.apply(env, dev=str(tmp_path)) == "" and env == {}
    for hidden in ("", "-1"):
        env = {"CUDA_VISIBLE_DEVICES": hidden}
        assert threads.apply(env, dev=str(tmp_path)) == "OMP_WAIT_POLICY=passive"


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "active"),
                                        ("GOMP_SPINCOUNT", "10000"), ("KMP_BLOCKTIME", "0")])
def test_a_users_own_setting_is_kept(name, value, tmp_path):
    env = {name: value}
    assert threads.apply(env, dev=str(tmp_path)) == f"{name}={value} (yours)" and env == {name: value}
