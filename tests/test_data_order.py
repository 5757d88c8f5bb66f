"""`OlmoData` reads OLMo-core's token files and global-indices file (goldens/data/) and gives the
batches OLMo-core's `NumpyFSLDataLoader` yielded (goldens/data/order.safetensors): the same
instances and tokens at every step, split into micro-batches and data shards as OLMo-core's ranks
split them, resumable from any step and from OLMo-core's saved loader state; files that do not fit
fail with a `DataError` that says why."""

import shutil

import numpy as np
import pytest

from goldens.store import resolve
from model.config import micro, olmo_core
from model.data import (
    LOOKAHEAD,
    DataError,
    OlmoData,
    olmo_labels,
    shift_to_inputs_targets,
    token_dtype,
)


@pytest.fixture(scope="module")
def order(golden):
    return golden("data/order.safetensors")


@pytest.fixture(scope="module")
def files(golden, order):
    """(token files, global-indices file) of the golden, each checked against the manifest."""
    config = order.entry["config"]
    for path in [*config["token_files"], config["global_indices_file"]]:
        golden(path)
    return [resolve(p) for p in config["token_files"]], resolve(config["global_indices_file"])


@pytest.fixture(scope="module")
def data(order, files):
    token_files, indices_file = files
    config = olmo_core(micro(), global_indices_path=str(indices_file))
    assert order.entry["config"]["seq_len"] == config.train.seq_len
    assert order.entry["config"]["instances_per_batch"] == config.train.global_batch_size
    return OlmoData.from_config(config, token_files)


def test_every_batch_has_olmo_core_s_instances(data, order):
    expected = order["instance_ids"]  # [batches, I]
    assert data.num_batches == len(expected)
    actual = np.stack([data.instance_ids(k) for k in range(data.num_batches)])
    np.testing.assert_array_equal(actual, expected)


def test_batches_across_the_epoch_have_olmo_core_s_tokens(data, order):
    """Steps 0..49 (the replay), the middle and the last batch of epoch 1."""
    for i, step in enumerate(order["steps"]):
        np.testing.assert_array_equal(
            data.global_batch(int(step)), order["input_ids"][i], err_msg=f"batch {step}"
        )


@pytest.mark.parametrize(("ga_steps", "num_shards"), [(1, 1), (2, 1), (2, 2), (1, 8), (4, 2)])
def test_micro_batches_are_olmo_core_s_rank_micro_batches(data, order, ga_steps, num_shards):
    """Rank r of W takes instances r::W of the batch and cuts them into ga_steps micro-batches of
    consecutive rows; our micro-batch m holds rank r's micro-batch m at rows [r * R:(r + 1) * R],
    each row an instance and the lookahead token, shifted to inputs and targets."""
    position = 3
    step = int(order["steps"][position])
    instances = order["input_ids"][position]  # [I, S]
    rows = instances.shape[0] // (num_shards * ga_steps)
    batch = data.micro_batches(
        step, ga_steps=ga_steps, num_shards=num_shards, segment_ids_from_eos=256
    )
    for m in range(ga_steps):
        for r in range(num_shards):
            rank_rows = instances[r::num_shards][m * rows : (m + 1) * rows]
            rank_rows = np.pad(rank_rows, ((0, 0), (0, 1)), constant_values=LOOKAHEAD)
            expected = shift_to_inputs_targets(rank_rows, segment_ids_from_eos=256)
            expected["labels"] = olmo_labels(expected["targets"], expected["targets_segmentation"])
            for key, value in expected.items():
                np.testing.assert_array_equal(
                    batch[key][m, r * rows : (r + 1) * rows], value, err_msg=f"{key} m={m} r={r}"
                )


def test_micro_batches_need_whole_shards(data):
    with pytest.raises(DataError, match="ga_steps=3 times num_shards=1 must divide the 8"):
        data.micro_batches(0, ga_steps=3)


def test_resume_from_olmo_core_state(data, order):
    """OLMo-core's state after 10 batches resumes at batch 10, and the batches from there are the
    ones OLMo-core's resumed loader yielded and the ones a run from step 0 reaches."""
    resume = order.entry["config"]["resume"]
    start = data.resume_step(resume["loader_state"])
    assert start == resume["after_batches"]
    resumed = data.batches(start=start, ga_steps=2, segment_ids_from_eos=256)
    from_zero = data.batches(ga_steps=2, segment_ids_from_eos=256)
    for _ in range(start):
        next(from_zero)
    for expected_ids in order["resumed_instance_ids"]:
        (step, batch), (step0, batch0) = next(resumed), next(from_zero)
        assert step == step0
        np.testing.assert_array_equal(data.instance_ids(step), expected_ids)
        for key in batch:
            np.testing.assert_array_equal(batch[key], batch0[key], err_msg=f"{key} at {step}")


def test_resume_refuses_other_orders(data, order):
    state = {**order.entry["config"]["resume"]["loader_state"], "max_target_sequence_length": 512}
    with pytest.raises(DataError, match="only the plain FSL order"):
        data.resume_step(state)


def _copy(files, tmp_path):
    token_files, indices_file = files
    copies = [shutil.copy(p, tmp_path / p.name) for p in token_files]
    return copies, shutil.copy(indices_file, tmp_path / indices_file.name)


def _open(token_files, indices_file, vocab_size=384):
    return OlmoData(
        token_files, indices_file, seq_len=256, instances_per_batch=8, vocab_size=vocab_size
    )


def test_missing_file(files, tmp_path):
    with pytest.raises(DataError, match=r"global-indices file .*nowhere.npy: no such file"):
        _open(files[0], tmp_path / "nowhere.npy")


def test_indices_of_another_dtype(files, tmp_path):
    token_files, indices_file = _copy(files, tmp_path)
    np.fromfile(indices_file, dtype="<u4").astype("<u8").tofile(indices_file)
    with pytest.raises(DataError, match=r"holds 4832 uint32 ids, but the token files make 2416"):
        _open(token_files, indices_file)


@pytest.mark.parametrize(
    ("cut", "message"),
    [(2, "is not a whole number of uint32"), (4, "holds 2415 uint32 ids")],
    ids=["mid-id", "whole-id"],
)
def test_truncated_indices(files, tmp_path, cut, message):
    token_files, indices_file = _copy(files, tmp_path)
    data = indices_file.read_bytes()
    indices_file.write_bytes(data[:-cut])
    with pytest.raises(DataError, match=message):
        _open(token_files, indices_file)


def test_npy_header(files, tmp_path):
    token_files, indices_file = _copy(files, tmp_path)
    np.save(token_files[0], np.fromfile(token_files[0], dtype="<u2"))
    with pytest.raises(DataError, match=r"starts with a \.npy header"):
        _open(token_files, indices_file)


def test_out_of_range_instance_id(files, tmp_path):
    token_files, indices_file = _copy(files, tmp_path)
    indices = np.fromfile(indices_file, dtype="<u4")
    indices[3 * 8 + 5] = len(indices)
    indices.tofile(indices_file)
    data = _open(token_files, indices_file)
    data.instance_ids(2)
    with pytest.raises(DataError, match=r"batch 3: instance id 2416 is out of range"):
        data.instance_ids(3)
    with pytest.raises(DataError, match=r"batch 302: the epoch has batches 0..301"):
        data.instance_ids(302)
    with pytest.raises(DataError, match=r"instance -1: the dataset has instances 0..2415"):
        data.instance(-1)


def test_token_id_outside_the_vocab(files, tmp_path):
    token_files, indices_file = _copy(files, tmp_path)
    tokens = np.fromfile(token_files[1], dtype="<u2")
    tokens[256 + 5] = 400  # instance 1 of the second file
    tokens.tofile(token_files[1])
    data = _open(token_files, indices_file)
    first = len(np.fromfile(token_files[0], dtype="<u2")) // 256  # the second file's first
    data.instance(first)
    with pytest.raises(DataError, match=rf"id 400 in instance {first + 1} is >= vocab_size 384"):
        data.instance(first + 1)


def test_global_indices_flag_required(files):
    with pytest.raises(DataError, match=r"Flags\.olmo_global_indices_path is not set"):
        OlmoData.from_config(micro(), files[0])


@pytest.mark.parametrize(
    ("vocab_size", "dtype"),
    [(256, "uint8"), (257, "uint16"), (384, "uint16"), (65536, "uint16"), (65537, "uint32")],
)
def test_token_dtype_is_olmo_core_s_choice(vocab_size, dtype):
    """What `NumpyDatasetConfig.get_dtype` picked for these vocab sizes, run on OLMo-core 3.0.0
    (shared/notes/olmo_core_data_and_trainer_on_cpu.md, section 1)."""
    assert token_dtype(vocab_size) == np.dtype(dtype)
