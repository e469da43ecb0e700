"""The Ray executor across two Ray nodes: a head and a second node, each its own raylet with its own
resources, started on this one machine by ``ray.cluster_utils.Cluster``. kiln joins the cluster
through RAY_ADDRESS, as on a real cluster, and STRICT_SPREAD puts its two ranks (gloo, fp32) on
different nodes; the greedy tokens and logprobs equal the single-process engine's.

What this does not cover: two hosts. Both raylets share this machine's IP address, so the ranks'
rendezvous and gloo traffic cross the loopback, not a network."""


import pytest

from kiln import LLM
from tests.helpers.parallel import assert_same_completions
from tests.helpers.ray_executor import GREEDY, PROMPTS, needs_ray, ray

if ray is not None:
    from ray.cluster_utils import Cluster
# Two logical CPUs per node: PACK would put both ranks on the head, so only STRICT_SPREAD splits them.
CPUS_PER_NODE = 2
SPREAD2 = {"tensor_parallel_size": 2, "backend": "ray", "placement_strategy": "STRICT_SPREAD"}


def _pids_alive(pids):
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def _parent_pid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head node and node "b", and RAY_ADDRESS naming the head. Finally: the driver leaves, both
    nodes stop, and none of their processes (GCS, raylets, workers) is left running."""
    if ray.is_initialized():
        pytest.skip("needs a driver not yet connected to a Ray cluster")
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=CPUS_PER_NODE, include_dashboard=False))
    node_b = cluster.add_node(num_cpus=CPUS_PER_NODE, resources={"node_b": 1})
    pids = [p.process.pid for node in cluster.list_all_nodes() for procs in node.all_processes.values()
            for p in procs]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ADDRESS", cluster.address)
        yield cluster, node_b, pids
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()
    assert _pids_alive(pids) == []


@needs_ray
def test_tp2_strict_spread_runs_one_rank_per_node_and_matches_tp1(two_node_cluster, kiln_cache_dir):
    cluster, node_b, pids = two_node_cluster
    llm = LLM("random:tiny", dtype="float32", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir},
              parallel=SPREAD2)
    try:
        executor = llm.engine.executor
        assert not executor._cluster.on_started  # joined the one RAY_ADDRESS names: kiln will not stop it
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        assert set(nodes) == {cluster.head_node.node_id, node_b.node_id}
        assert nodes[node_b.node_id]["node_b"] == 1
        table = ray.util.placement_group_table(executor._placement)
        assert table["strategy"] == "STRICT_SPREAD"
        bundle_nodes = [table["bundles_to_node_id"][rank] for rank in range(2)]
        assert sorted(bundle_nodes) == sorted(nodes)  # one bundle per node
        # Rank r's actor runs in bundle r; a Ray worker process is started by its node's raylet,
        # so the actor's parent process says which node it really ran on.
        raylet_of = {node.node_id: node.all_processes["raylet"][0].process.pid for node in cluster.list_all_nodes()}
        rank_pids = [pid for _, pid in executor.whereabouts]
        assert [_parent_pid(pid) for pid in rank_pids] == [raylet_of[node_id] for node_id in bundle_nodes]
        sharded = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert ray.is_initialized()  # a cluster kiln did not start stays up
    assert _pids_alive(rank_pids) == []
    single = LLM("random:tiny", dtype="float32", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir})
    want = [o.outputs[0] for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert_same_completions(sharded, want)
