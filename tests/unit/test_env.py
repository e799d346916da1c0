"""Launch-environment detection from synthetic environments, and Slurm node lists."""

import pytest

from ringpipe.env import (
    EnvironmentError_,
    Topology,
    detect,
    expand_nodelist,
    expand_tasks_per_node,
    slurm_port,
)


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("host", ["host"]),
        ("gpu[008-011]", ["gpu008", "gpu009", "gpu010", "gpu011"]),
        ("x[9-10]", ["x9", "x10"]),
        ("n[1,3],m[01-02],solo", ["n1", "n3", "m01", "m02", "solo"]),
    ],
)
def test_expand_nodelist(spec, hosts):
    assert expand_nodelist(spec) == hosts


def test_expand_nodelist_errors():
    with pytest.raises(ValueError, match="unbalanced"):
        expand_nodelist("node[01-02")
    with pytest.raises(ValueError, match="descending"):
        expand_nodelist("node[05-02]")


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node("2(y3)")


def test_single_process():
    t = detect({})
    assert (t.rank, t.size, t.local_rank, t.local_size, t.node_rank, t.num_nodes) == (0, 1, 0, 1, 0, 1)
    assert t.launcher == "single"


def test_torchrun():
    env = {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
    }
    t = detect(env)
    assert (t.rank, t.size, t.local_rank, t.local_size, t.node_rank, t.num_nodes) == (5, 8, 1, 4, 1, 2)
    assert (t.launcher, t.master_addr, t.master_port) == ("torchrun", "10.0.0.1", 29500)


def test_open_mpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    t = detect(env)
    assert (t.rank, t.size, t.local_rank, t.local_size, t.node_rank, t.num_nodes) == (3, 4, 1, 2, 1, 2)
    assert t.launcher == "openmpi" and t.master_addr is None


def test_intel_mpi_and_cray():
    intel = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    t = detect(intel)
    assert (t.rank, t.size, t.local_rank, t.local_size, t.launcher) == (2, 4, 0, 2, "mpich")
    cray = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"}
    t = detect(cray)
    assert (t.rank, t.local_rank, t.local_size) == (1, 1, 2)


def test_slurm():
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "node[01-03],gpu7", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
    }
    t = detect(env)
    assert (t.rank, t.size, t.local_rank, t.local_size, t.node_rank, t.num_nodes) == (5, 7, 1, 2, 2, 4)
    assert t.master_addr == "node01"
    assert t.master_port == slurm_port("123456") == 20000 + 123456 % 20000


def test_priority_torchrun_over_mpi_over_slurm():
    env = {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
        "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
    }
    assert detect(env).launcher == "torchrun"
    del env["RANK"]
    assert detect(env).launcher == "openmpi"


def test_explicit_wins():
    t = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, rank=0, size=3)
    assert (t.rank, t.size, t.launcher) == (0, 3, "explicit")


def test_inconsistent_environment_names_variables():
    with pytest.raises(EnvironmentError_, match="rank=4 must be in"):
        detect({"RANK": "4", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(EnvironmentError_, match="OMPI_COMM_WORLD_RANK"):
        detect({"OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(EnvironmentError_, match="WORLD_SIZE='two'"):
        detect({"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"})
    with pytest.raises(EnvironmentError_, match="SLURM_JOB_ID"):
        detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_STEP_ID": "0"})


@pytest.mark.parametrize(
    "env, missing, setter",
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "LOCAL_RANK is not", "torchrun"),
        ({"LOCAL_RANK": "0"}, "RANK, WORLD_SIZE are not", "torchrun"),
        ({"TORCHELASTIC_RUN_ID": "x"}, "RANK, WORLD_SIZE, LOCAL_RANK are not", "torchrun"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_SIZE is not", "mpirun"),
        ({"PMI_RANK": "1"}, "PMI_SIZE is not", "mpiexec"),
        ({"PMI_SIZE": "2"}, "PMI_RANK is not", "mpiexec"),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}, "SLURM_NTASKS or SLURM_NPROCS is not", "srun"),
        ({"SLURM_STEP_ID": "3", "SLURM_NTASKS": "2"}, "SLURM_PROCID is not", "srun"),
    ],
)
def test_partial_launcher_variables_are_an_error(env, missing, setter):
    """A partial set never becomes a silent single process: the error names what is missing and who sets it."""
    with pytest.raises(EnvironmentError_) as info:
        detect(env)
    msg = str(info.value)
    assert missing in msg and setter in msg
    for name, value in env.items():
        assert f"{name}={value}" in msg


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
        # sbatch without srun: the batch script is one process, with SLURM_PROCID=0 and the job's task count.
        {"SLURM_JOB_ID": "42", "SLURM_JOBID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
         "SLURM_TASKS_PER_NODE": "2(x2)", "ENVIRONMENT": "BATCH"},
        {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0"},  # sbatch without -n
        {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "-5"},  # batch step id
        {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"},  # salloc shell
        {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "extern"},
    ],
)
def test_single_process_environments(env):
    """Plain runs and the partial sets that batch scripts and allocation shells really carry stay single."""
    t = detect(env)
    assert (t.launcher, t.rank, t.size) == ("single", 0, 1)


def test_complete_launcher_wins_over_a_partial_one():
    """A stray variable of another launcher does not hide a complete world (srun task that set LOCAL_RANK)."""
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_ID": "7", "LOCAL_RANK": "1"}
    t = detect(env)
    assert (t.launcher, t.rank, t.size) == ("slurm", 1, 2)


def test_with_hostnames_derives_nodes():
    t = Topology(rank=3, size=5, local_rank=0, local_size=5, launcher="openmpi")
    t = t.with_hostnames(["b", "b", "a", "a", "c"])
    assert (t.node_rank, t.num_nodes, t.local_rank, t.local_size) == (1, 3, 1, 2)
    assert t.ranks_on_node() == [2, 3]
    assert t.node_leaders() == [0, 2, 4]


def test_torch_variables_copied_from_mpirun_keep_the_mpi_launcher():
    """ringpipe launch --backend mpi exports RANK/WORLD_SIZE beside mpirun's own: the launcher is still MPI."""
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    t = detect(env)
    assert (t.launcher, t.rank, t.size, t.local_rank) == ("openmpi", 1, 2, 1)
    env["RANK"] = "0"  # disagreeing values: torchrun started this process under an mpirun
    assert detect(env).launcher == "torchrun"
