"""How torch's CPU threads wait (fp8train/train/threads.py): passive unless the user chose, set
in the environment torch will read. Measured under a competing process:
tests/e2e/test_cpu_threads.py."""
import pytest

from fp8train.train import threads


def test_the_policy_is_passive_unless_the_user_chose_one():
    env = {}
    assert threads.apply(env) == "OMP_WAIT_POLICY=passive" and env == {
        "OMP_WAIT_POLICY": "passive"}


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "active"),
                                        ("GOMP_SPINCOUNT", "10000"), ("KMP_BLOCKTIME", "0")])
def test_a_users_own_setting_is_kept(name, value):
    env = {name: value}
    assert threads.apply(env) == f"{name}={value} (yours)" and env == {name: value}
