"""Checksum verification on several ranks: the files are split, every rank gets the same error.

Two ranks save a checkpoint (one shard file each). Loading it checks each data file on one
rank only; after one rank's shard is changed, both ranks refuse the load with the same
``CheckpointError`` naming that file (the rank that did not read it too, instead of entering
DCP's load alone). Ranks of one group loading different directories (each its SM-local
shard's) still get every file of their own directory checked. Note [Checkpoint checksums].
Ranks naming different checkpoints of any other kind are refused (Note [The ranks of a load
read one checkpoint]), and the example's 'latest' is rank 0's choice.
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed


def _flip_a_bit_in_the_middle(path: str) -> None:
    with open(path, "r+b") as f:
        middle = f.seek(0, 2) // 2
        f.seek(middle)
        byte = f.read(1)[0]
        f.seek(middle)
        f.write(bytes([byte ^ 0x01]))


def _shard_checks(root: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from torch_sagemaker.checkpoint import CheckpointError, integrity, load, save
    from torch_sagemaker.checkpoint.state_dict_utils import local_state_dict

    rank = dist.get_rank()
    checked: list[str] = []
    real = integrity.file_checksum

    def counting(path):
        checked.append(path.name)
        return real(path)

    integrity.file_checksum = counting
    try:
        state = {f"w{rank}": torch.full((4096,), float(rank + 1))}
        save(state, checkpoint_id=f"{root}/c")
        template = {f"w{rank}": torch.zeros(4096)}
        checked.clear()
        load(template, checkpoint_id=f"{root}/c", check_keys_matched=False)
        clean = {"checked": sorted(checked), "value": float(template[f"w{rank}"][0])}

        # Each rank saves its own SM-local shard, then the whole group loads them, each rank
        # its own directory (each directory's files are then checked on its own rank).
        shard = nn.Linear(8, 8)
        save(
            {"model": local_state_dict(shard)},
            checkpoint_id=f"{root}/own{rank}",
            process_group=dist.new_group([rank]),
        )
        checked.clear()
        load({"model": local_state_dict(nn.Linear(8, 8))}, checkpoint_id=f"{root}/own{rank}")
        own = sorted(checked)

        dist.barrier()
        if rank == 0:
            _flip_a_bit_in_the_middle(f"{root}/c/__1_0.distcp")  # inside rank 1's tensor
        dist.barrier()
        try:
            load(
                {f"w{rank}": torch.zeros(4096)}, checkpoint_id=f"{root}/c", check_keys_matched=False
            )
            corrupt = "no error"
        except CheckpointError as e:
            corrupt = str(e)
    finally:
        integrity.file_checksum = real
    return {**clean, "own": own, "corrupt": corrupt}


def test_files_are_checked_once_and_corruption_stops_every_rank(tmp_path):
    results = run_distributed(_shard_checks, str(tmp_path), world_size=2)
    # Every data file checked by exactly one rank; .metadata by each (it is tiny).
    data = [[n for n in r["checked"] if n != ".metadata"] for r in results]
    assert sorted(data[0] + data[1]) == ["__0_0.distcp", "__1_0.distcp"], results
    assert [r["value"] for r in results] == [1.0, 2.0]
    for r in results:
        assert r["own"] == [".metadata", "__0_0.distcp"], r
    errors = {r["corrupt"] for r in results}
    assert len(errors) == 1, errors  # the very same error on both ranks
    (error,) = errors
    assert f"{tmp_path}/c is corrupt: __1_0.distcp does not match its crc32 checksum" in error


def _ranks_naming_other_checkpoints(root: str) -> list[str]:
    import torch
    import torch.distributed as dist

    from torch_sagemaker.checkpoint import CheckpointError, load, save
    from torch_sagemaker.checkpoint.atomic_dir import LocalDirectory

    rank = dist.get_rank()
    for name, step in (("a", 7), ("b", 9)):
        save({"w": torch.full((4,), float(step)), "step": step}, checkpoint_id=f"{root}/{name}")
    out = []
    template = {"w": torch.zeros(4), "step": 0}
    try:  # each rank resolved "latest" itself, and a save committed in between
        load(template, checkpoint_id=f"{root}/{'a' if rank == 0 else 'b'}")
        out.append(f"loaded step {template['step']}")
    except CheckpointError as e:
        out.append(str(e))
    # One name, but rank 1 read the marker of a save that committed over it meanwhile.
    real = LocalDirectory.marker_save_id
    if rank == 1:
        LocalDirectory.marker_save_id = lambda self: "f" * 32
    try:
        load(template, checkpoint_id=f"{root}/a")
        out.append(f"loaded step {template['step']}")
    except CheckpointError as e:
        out.append(str(e))
    finally:
        LocalDirectory.marker_save_id = real
    load(template, checkpoint_id=f"{root}/b")  # the same checkpoint on every rank loads
    out.append(f"loaded step {template['step']}")
    return out


def test_ranks_naming_different_checkpoints_are_refused_on_every_rank(tmp_path):
    """Before, rank 0 resumed at step 7 and rank 1 at step 9, silently."""
    results = run_distributed(_ranks_naming_other_checkpoints, str(tmp_path), timeout=60)
    other, resaved = results[0][0], results[0][1]
    assert [r[:2] for r in results] == [[other, resaved]] * 2, results  # one error everywhere
    assert "the ranks loading together name different checkpoints" in other, other
    assert f"rank 0: {tmp_path}/a (save id " in other and f"rank 1: {tmp_path}/b" in other
    assert "pass the same checkpoint_id on every rank" in other
    assert "read different saves of one checkpoint" in resaved, resaved
    assert f"rank 1: {tmp_path}/a (save id {'f' * 32})" in resaved and "Load it again" in resaved
    assert [r[2] for r in results] == ["loaded step 9"] * 2


def _training_state_kind_full_without_tsm(root: str) -> list[str]:
    from torch import nn

    from torch_sagemaker.checkpoint.training_state import TrainingState

    if tsm_initialized():
        return ["tsm was initialized in this pool"]
    state = TrainingState(nn.Linear(4, 4), save_rng=False)
    state.save(f"{root}/step1")
    out = []
    for call in (
        lambda: state.load(f"{root}/step1", kind="full"),
        lambda: state.save(f"{root}/step2", kind="full"),
    ):
        try:
            call()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def test_an_unknown_training_state_kind_is_named_in_a_job_without_tsm_init(tmp_path):
    """kind='full' (a type of SMP's scripts) was told that kind='local' needs tsm.init()."""
    results = run_distributed(_training_state_kind_full_without_tsm, str(tmp_path), timeout=60)
    for messages in results:
        assert len(messages) == 2, messages
        for m in messages:
            assert "kind='full'): kind must be one of ('sharded', 'local')" in m, m
            assert "save_hf_checkpoint" in m and "init()" not in m, m


def _the_examples_latest(examples: str, root: str) -> list:
    import sys

    import torch.distributed as dist

    sys.path.insert(0, examples)
    from train_lib import checkpoints

    rank = dist.get_rank()
    real = checkpoints.step_dirs
    loaded: list = []
    stub = type("State", (), {"load": lambda self, path: loaded.append(path)})()
    try:
        # A save committed between the ranks' listings: rank 1 would see a newer step.
        newest = {0: [(5, f"{root}/m-5steps")], 1: [(5, f"{root}/m-5steps"), (6, "six")]}
        checkpoints.step_dirs = lambda _root: newest[rank]
        out = [checkpoints.resume(stub, root, "latest")]
        newest = {0: [], 1: [(6, "six")]}  # rank 0 found none: no rank resumes
        out.append(checkpoints.resume(stub, root, "auto"))

        def unlistable(_root):  # rank 0's listing fails (storage unreachable)
            raise OSError(5, "Input/output error")

        checkpoints.step_dirs = unlistable
        try:
            checkpoints.resume(stub, root, "latest")
        except (OSError, RuntimeError) as e:  # before, rank 1 waited in the broadcast
            out.append(f"{type(e).__name__}: {e}")
    finally:
        checkpoints.step_dirs = real
        sys.path.remove(examples)
    return [out, loaded]


def test_the_examples_latest_checkpoint_is_rank_0s_choice_on_every_rank(tmp_path):
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[2] / "examples")
    results = run_distributed(_the_examples_latest, examples, str(tmp_path), timeout=60)
    want = f"{tmp_path}/m-5steps"
    assert [[r[0][:2], r[1]] for r in results] == [[[want, None], [want]]] * 2, results
    assert results[0][0][2] == "OSError: [Errno 5] Input/output error", results
    assert results[1][0][2] == (
        f"RuntimeError: rank 0 failed listing the checkpoints under {tmp_path}: "
        "OSError: [Errno 5] Input/output error"
    ), results


def _local_kind_without_tsm(root: str) -> str:
    import torch
    from torch import nn

    from torch_sagemaker.checkpoint.training_state import TrainingState

    if tsm_initialized():
        return "tsm was initialized in this pool"
    model = nn.Linear(4, 4)
    state = TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        state.save(f"{root}/step1", kind="local")
    except ValueError as e:
        return str(e)
    return "saved"


def tsm_initialized() -> bool:
    from torch_sagemaker.state import state

    return state.initialized


def test_sm_local_save_without_tsm_init_fails_at_once_on_every_rank(tmp_path):
    """Without tsm's layout every rank would coordinate its own save over the whole world
    (each broadcasting from itself): a hang until the group's timeout, not a save."""
    results = run_distributed(
        _local_kind_without_tsm, str(tmp_path), world_size=2, timeout=60, fresh=True
    )
    assert all("needs torch.sagemaker.init() first" in r for r in results), results


def _one_rank_asks_for_another_shape(root: str) -> str:
    import torch
    import torch.distributed as dist

    from torch_sagemaker.checkpoint import CheckpointError, load, save

    save({"w": torch.ones(8)}, checkpoint_id=f"{root}/c")
    shape = 8 if dist.get_rank() == 0 else 9  # rank 1's script differs
    try:
        load({"w": torch.zeros(shape)}, checkpoint_id=f"{root}/c")
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_load_that_fails_its_checks_on_one_rank_fails_on_every_rank_at_once(tmp_path):
    """Rank 1's checks fail before any collective; rank 0 must not wait for it in the next
    one until the group's timeout."""
    results = run_distributed(_one_rank_asks_for_another_shape, str(tmp_path), timeout=60)
    assert "checkpoint shape (8,), requested (9,)" in results[1]
    assert "rank 1 could not load it" in results[0] and "requested (9,)" in results[0]


def _ranks_at_other_data_positions(root: str) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from torch_sagemaker.checkpoint.training_state import TrainingState

    model = nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    messages = []
    for step, position in ((3, {"samples": 96 + rank}), (3 + rank, {"samples": 96})):
        try:
            TrainingState(model, optim, step=step, data_position=position).save(f"{root}/s")
            messages.append("saved")
        except ValueError as e:
            messages.append(str(e))
    TrainingState(model, optim, step=3, data_position={"samples": 96}).save(f"{root}/s")
    return messages


def test_ranks_saving_different_steps_or_data_positions_are_refused(tmp_path):
    """A sharded checkpoint keeps one copy of them: the resumed run would take one rank's."""
    for messages in run_distributed(_ranks_at_other_data_positions, str(tmp_path), timeout=60):
        assert all(
            "ranks [1] save another step or data position than rank 0" in m for m in messages
        )
    assert (tmp_path / "s" / ".sm_checkpoint_complete.json").is_file()


def _hf_export_written_by_rank_1_of_a_rank_0_gather(root: str) -> list:
    """What ``cpu_offload`` does on CUDA (the full state dict on global rank 0 only),
    played on the CPU: the writing rank must not commit an empty model, and a
    ``translate_fn`` runs on the writing rank only (elsewhere it would find no keys)."""
    import torch
    import torch.distributed as dist
    import transformers

    from torch_sagemaker.checkpoint import CheckpointError, hf_export

    gather = hf_export.get_model_state_dict
    hf_export.get_model_state_dict = lambda m, options: gather(m) if dist.get_rank() == 0 else {}
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2,
        )
    )  # fmt: skip
    out = []
    seen: list = []

    def translate(sd: dict) -> dict:
        seen.append(sd["lm_head.weight"].shape)
        return sd

    for coordinator in (1, 0):
        seen.clear()
        try:
            hf_export.save_hf_checkpoint(
                model,
                f"{root}/hf{coordinator}",
                coordinator_rank=coordinator,
                translate_fn=translate,
            )
            out.append(("saved", len(seen)))
        except CheckpointError as e:
            out.append((str(e), len(seen)))
    hf_export.get_model_state_dict = gather
    del torch
    return out


def test_an_hf_export_never_commits_an_empty_model_nor_translates_where_it_does_not_write(
    tmp_path,
):
    results = run_distributed(
        _hf_export_written_by_rank_1_of_a_rank_0_gather, str(tmp_path), timeout=120
    )
    for rank, (by_1, by_0) in enumerate(results):
        assert "the gathered state dict is empty on the writing rank" in by_1[0], by_1
        assert by_1[1] == 0  # rank 1 wrote, and its dict is empty: translate_fn never ran
        assert by_0 == ("saved", 1 if rank == 0 else 0), by_0
    assert not (tmp_path / "hf1").exists()
    assert (tmp_path / "hf0" / "model.safetensors").is_file()


def _parts_of_two_saves(root: str) -> list:
    import json

    import torch
    import torch.distributed as dist
    from torch import nn

    from torch_sagemaker.checkpoint import CheckpointError, save
    from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER
    from torch_sagemaker.checkpoint.location import checkpoint_location
    from torch_sagemaker.checkpoint.training_state import TrainingState
    from torch_sagemaker.checkpoint.training_state_checks import agree_on_parts

    rank = dist.get_rank()
    TrainingState(nn.Linear(2, 2), save_rng=False).save(f"{root}/whole")
    from pathlib import Path

    marker = json.loads(Path(f"{root}/whole/{COMPLETION_MARKER}").read_text())
    out: list = [(len(marker["whole_save_id"]), marker["num_parts"])]
    own = dist.new_group([rank])  # each rank's part is committed by its own group
    top = checkpoint_location(f"{root}/step")
    for whole_id in ("a" * 32, "b" * 32 if rank == 0 else None):  # rank 1 died before its commit
        if whole_id is not None:
            save(
                {"w": torch.full((4,), float(rank))},
                checkpoint_id=f"{root}/step/tp2-{rank}",
                process_group=own,
                marker_info={"whole_save_id": whole_id, "num_parts": 2},
            )
        dist.barrier()
        try:  # what TrainingState.load of an FSDP1 + TP model runs before its group's load
            agree_on_parts(top, top.child(f"tp2-{rank}"))
            out.append("agreed")
        except CheckpointError as e:
            out.append(str(e))
    return out


def test_parts_of_two_saves_are_refused_on_every_rank(tmp_path):
    """Before, each TP rank's group loaded its own part: half the model from each save."""
    results = run_distributed(_parts_of_two_saves, str(tmp_path), timeout=60)
    assert results[0] == results[1], results
    assert results[0][:2] == [(32, 1), "agreed"], results
    message = results[0][2]
    assert f"checkpoint {tmp_path}/step holds parts written by different saves" in message
    assert f"tp2-0 (save {'b' * 32})" in message, message
    assert f"tp2-1 (save {'a' * 32})" in message and "save it again" in message


def _tp_local_shards_over_tp_ranks(root: str) -> list:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from torch_sagemaker.checkpoint import load, save
    from torch_sagemaker.sharding import fsdp1_layout

    rank = dist.get_rank()
    # What FSDP1 gives under TP=2, hybrid_shard_degree 1: each TP rank's TP-local tensor on
    # FSDP's one-rank mesh, under the same key (SMPFSDPExtensions.chunk_dtensor notes the mesh).
    mesh = DeviceMesh("cpu", [rank])
    fsdp1_layout.note_tp_local_mesh(mesh)
    try:
        shard = DTensor.from_local(torch.full((4,), rank + 1.0), mesh, [Shard(0)], run_check=False)
        out = []
        try:
            save({"model": {"w": shard}}, checkpoint_id=f"{root}/whole")
            out.append("saved")
        except ValueError as e:
            out.append(str(e))
        # One directory per TP rank, each over its own ranks (SMP's scripts, TrainingState).
        own = dist.new_group([rank])
        save({"w": shard}, checkpoint_id=f"{root}/tp2-{rank}", process_group=own)
        back = {"w": DTensor.from_local(torch.zeros(4), mesh, [Shard(0)], run_check=False)}
        load(back, checkpoint_id=f"{root}/tp2-{rank}", process_group=own)
        out.append(back["w"].to_local().tolist())
        return out
    finally:
        fsdp1_layout._TP_LOCAL_MESHES.clear()


def test_fsdp1_tp_local_shards_saved_over_tp_ranks_are_refused(tmp_path):
    """Before, rank 1's shard was dropped by DCP's deduplication: both ranks loaded rank 0's."""
    results = run_distributed(_tp_local_shards_over_tp_ranks, str(tmp_path), timeout=60)
    for rank, (error, loaded) in enumerate(results):
        assert "model.w is an FSDP1 shard of a model with tensor or expert parallelism" in error
        assert f"(its mesh: ranks [{rank}])" in error and "spans ranks [0, 1]" in error, error
        assert "tp{degree}-{rank}" in error and "TrainingState.save" in error
        assert loaded == [rank + 1.0] * 4
    assert not (tmp_path / "whole").exists()


def _dcp_load_of_a_changed_shard(root: str) -> str:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from torch_sagemaker.checkpoint import save
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    rank = dist.get_rank()
    save({f"w{rank}": torch.full((4096,), float(rank + 1))}, checkpoint_id=f"{root}/c")
    dist.barrier()
    if rank == 0:  # inside rank 1's tensor, which only rank 1 reads
        _flip_a_bit_in_the_middle(f"{root}/c/__1_0.distcp")
    dist.barrier()
    try:  # as SMP's scripts load optimizer states: DCP's load with SMP's reader
        dcp.load(
            {f"w{rank}": torch.zeros(4096)},
            storage_reader=DistributedFileSystemReader(f"{root}/c"),
        )
        return "no error"
    except CheckpointException as e:
        return str(e)


def test_dcp_load_through_the_smp_reader_stops_every_rank_on_a_changed_shard(tmp_path):
    errors = run_distributed(_dcp_load_of_a_changed_shard, str(tmp_path), world_size=2)
    for error in errors:  # rank 0, which read only its own intact file, too
        assert "__1_0.distcp does not match its crc32 checksum" in error, errors


def _training_state_load_failing_on_one_rank(root: str) -> dict:
    import time

    import torch.distributed as dist
    from torch import nn

    from torch_sagemaker.checkpoint import CheckpointError, TrainingState, training_state

    rank = dist.get_rank()
    model = nn.Linear(4, 4)
    TrainingState(model, step=3, save_rng=False).save(f"{root}/c")
    real = training_state.read_metadata

    def unreadable_on_rank_1(path):
        if rank == 1:  # a transient storage error on one host
            raise OSError(5, "Input/output error", str(path))
        return real(path)

    training_state.read_metadata = unreadable_on_rank_1
    start = time.monotonic()
    try:
        TrainingState(nn.Linear(4, 4), save_rng=False).load(f"{root}/c")
        error = "no error"
    except (CheckpointError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        training_state.read_metadata = real
    seconds = time.monotonic() - start
    loader = TrainingState(nn.Linear(4, 4), save_rng=False)
    loader.load(f"{root}/c")  # the group is still usable
    return {"error": error, "seconds": seconds, "step": loader.step}


def test_a_training_state_check_failing_on_one_rank_fails_every_rank_at_once(tmp_path):
    """Before, rank 1 raised alone and rank 0 waited in the load's first collective until the
    group's timeout (120 s here)."""
    results = run_distributed(
        _training_state_load_failing_on_one_rank, str(tmp_path), timeout=90, pg_timeout=60
    )
    assert results[1]["error"].startswith("OSError: [Errno 5] Input/output error"), results
    assert results[0]["error"].startswith(f"CheckpointError: loading {tmp_path}/c: rank 1 could")
    assert "Input/output error" in results[0]["error"]
    assert all(r["seconds"] < 20 for r in results), results  # not the group's timeout
    assert [r["step"] for r in results] == [3, 3]


def _a_load_in_parts_failing_in_one_part(root: str) -> dict:
    import json
    import time
    from pathlib import Path

    import torch.distributed as dist
    from torch import nn

    from torch_sagemaker.checkpoint import TrainingState, save, training_state
    from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER

    rank = dist.get_rank()
    own = [dist.new_group([0]), dist.new_group([1])]

    def one_part_per_rank(self, path, kind):  # as for FSDP1 with TP 2: a group per part
        return path.child(f"tp2-{rank}"), own[rank], rank

    real_location, real_read = TrainingState._location, training_state.read_metadata
    TrainingState._location = one_part_per_rank
    out: dict = {}

    def load_as(name: str) -> None:
        start = time.monotonic()
        try:
            state = TrainingState(nn.Linear(4, 4), save_rng=False)
            state.load(f"{root}/c")
            out[name] = f"loaded step {state.step}"
        except Exception as e:  # noqa: BLE001 - reported
            out[name] = f"{type(e).__name__}: {e}"
        out[name + " s"] = time.monotonic() - start

    try:
        TrainingState(nn.Linear(4, 4), step=3, save_rng=False).save(f"{root}/c")
        dist.barrier()  # each part commits on its own: both are there before the load

        def unreadable_on_rank_1(path):
            if rank == 1:
                raise OSError(5, "Input/output error", str(path))
            return real_read(path)

        training_state.read_metadata = unreadable_on_rank_1
        load_as("read error")
        dist.barrier()
        part = json.loads(Path(f"{root}/c/tp2-1/{COMPLETION_MARKER}").read_text())

        def part_1_saved_again_meanwhile(path):
            metadata = real_read(path)
            if rank == 1:
                again = TrainingState(nn.Linear(4, 4), step=4, save_rng=False).state_dict()
                info = {k: part[k] for k in ("whole_save_id", "num_parts")}
                save(again, checkpoint_id=path, process_group=own[1], marker_info=info)
            return metadata

        training_state.read_metadata = part_1_saved_again_meanwhile
        load_as("replaced")
    finally:
        training_state.read_metadata = real_read
        TrainingState._location = real_location
    return out


def test_a_load_in_parts_fails_every_part_when_one_fails(tmp_path):
    """Each part's group agrees within itself; before, the other parts' ranks returned with
    their parts loaded and waited for the failed ones in the next collective."""
    results = run_distributed(
        _a_load_in_parts_failing_in_one_part, str(tmp_path), timeout=120, pg_timeout=60, fresh=True
    )
    mine, other = results[1], results[0]
    assert mine["read error"].startswith("OSError: [Errno 5]"), results
    assert mine["replaced"].startswith(f"CheckpointError: loading {tmp_path}/c/tp2-1: another")
    for case in ("read error", "replaced"):
        assert other[case].startswith(
            f"CheckpointError: loading checkpoint {tmp_path}/c: the part of rank 1 failed"
        ), other
        assert other[case + " s"] < 20 and mine[case + " s"] < 20, results


def _fsdp1_optimizer_readers_made_around_a_save(root: str) -> dict:
    import json
    import os
    import shutil
    import time
    import uuid
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from torch_sagemaker.checkpoint import fsdp1_checkpoint as util
    from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = FSDP(nn.Linear(8, 8), device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    meta, c = (None, 0, True), f"{root}/ckpt"
    kind = StateDictType.SHARDED_STATE_DICT
    util.save_model_checkpoint(model, kind, c, None, meta, optimizer=optimizer)
    real = util.DistributedFileSystemReader

    def another_save_commits() -> None:  # the same bytes under a new save id
        shutil.copytree(c, c + ".new")
        marker_file = Path(f"{c}.new/{COMPLETION_MARKER}")
        marker = json.loads(marker_file.read_text())
        marker["save_id"] = uuid.uuid4().hex
        marker_file.write_text(json.dumps(marker))
        os.replace(c, c + ".old")
        os.replace(c + ".new", c)

    def reader(path):  # rank 1 makes its reader before the save commits, rank 0 after
        if rank == 1:
            made = real(path)
            another_save_commits()
            dist.barrier()
            return made
        dist.barrier()
        return real(path)

    util.DistributedFileSystemReader = reader
    start = time.monotonic()
    try:
        util.load_model_checkpoint(model, kind, c, None, meta, optimizer=optimizer)
        result = "loaded"
    except Exception as e:  # noqa: BLE001 - reported
        result = f"{type(e).__name__}: {e}"
    finally:
        util.DistributedFileSystemReader = real
    return {"result": result, "seconds": time.monotonic() - start}


def test_fsdp1_optimizer_readers_of_different_saves_fail_every_rank_at_once(tmp_path):
    """Rank 1's reader fails its check when the optimizer's metadata is read, outside DCP's
    collectives; before, rank 0 waited in the load's first collective until the timeout."""
    results = run_distributed(
        _fsdp1_optimizer_readers_made_around_a_save,
        str(tmp_path),
        timeout=120,
        pg_timeout=60,
        fresh=True,
    )
    assert "another save committed over this checkpoint" in results[1]["result"], results
    assert results[0]["result"].startswith(
        "CheckpointError: reading the optimizer's checkpoint failed on rank 1: "
    ), results
    assert all(r["seconds"] < 20 for r in results), results
