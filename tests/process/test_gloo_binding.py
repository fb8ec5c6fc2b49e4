"""gloo binds to Ray's node address, not to what the host name resolves to (workers/bind.py, issue 35).

A rank process whose host name resolves to 127.0.1.1 (Debian's /etc/hosts), made on this machine with
a UTS and a mount namespace of its own (its own host name, its own /etc/hosts bind-mounted): gloo's
groups listen on 127.0.1.1 when nothing chooses, and on the node address given (127.0.0.1 here, on
``lo``) when ``build_process_groups`` is handed it — the groups a generation makes later
(``RankGroups.new_group``: the pipeline-tied embedding's pairs) too, and their listeners are among
the ports a kick shuts. Peers on other hosts (network namespaces) are tests/e2e's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

RANK = r'''
import json, torch, torch.distributed as dist
from meshspeak.mesh import MeshShape
from workers.bind import listener_addresses
from workers.groups import build_process_groups

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
out = {}
for gen, bind_ip in ((1, None), (2, "127.0.0.1")):
    groups = build_process_groups(store_addr="127.0.0.1", store_port=store.port, generation=gen,
                                  shape=MeshShape(1, 1, 1), world_rank=0, timeout_s=30,
                                  device=torch.device("cpu"), bind_ip=bind_ip)
    before = list(groups.gloo_ports)
    groups.new_group([0], "gloo", 30)
    added = sorted(set(groups.gloo_ports) - set(before))
    out[str(bind_ip)] = {"groups": sorted(listener_addresses(before)), "later": sorted(listener_addresses(added)),
                         "added": len(added)}
    groups.destroy()
print("RESULT " + json.dumps(out))
'''


def test_a_host_name_on_127_0_1_1_does_not_decide_where_gloo_listens(tmp_path):
    if not shutil.which("unshare") or os.geteuid() != 0:
        pytest.skip("needs root and unshare (a host name and /etc/hosts of the test's own)")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.1.1 em-debian-host\n")
    shell = (f"mount --bind {hosts} /etc/hosts && hostname em-debian-host && "
             f"exec {sys.executable} -c \"$RANK\"")
    out = subprocess.run(["unshare", "--mount", "--uts", "sh", "-c", shell], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env={**os.environ, "RANK": RANK, "PYTHONPATH": str(REPO)})
    if out.returncode != 0 and "unshare failed" in out.stderr:
        pytest.skip(f"no namespaces here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    assert result["None"]["groups"] == ["127.0.1.1"]  # gloo's own choice: the host name's address
    assert result["127.0.0.1"] == {"groups": ["127.0.0.1"], "later": ["127.0.0.1"], "added": 1}
