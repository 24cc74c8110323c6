"""``offload_core.from_pretrained`` checks a checkpoint before it builds or enables anything: every
safetensors header is held to the rules the safetensors library enforces (and refused where it
refuses), every path the folder names is confined to the folder, and a config may name only a
model class. Each refusal is a ``CheckpointError`` naming the file (and the tensor), for the RAM
and the disk tier alike, and leaves no handle, thread, descriptor or spill file behind; what the
safetensors library accepts loads exactly."""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest
import torch
from safetensors import safe_open

import offload_core
from offload_core import CheckpointError

from checkpoints import INDEX, WEIGHTS, Reads, copy_folder, read_header, save, tiny_wan, write
from helpers import chaos_backend, descriptors_under, forward

pytestmark = pytest.mark.fake_only

TIERS = {"ram": None, "disk": 0}


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A tiny Wan DiT saved whole and sharded, a decoy checkpoint of other weights beside both
    folders, the model's state and its output."""
    root = tmp_path_factory.mktemp("checkpoints")
    model, inputs = tiny_wan(seed=0)
    save(model, root / "single")
    save(model, root / "sharded", sharded=True)
    decoy, _ = tiny_wan(seed=1)
    save(decoy, root / "decoy")
    os.rename(root / "decoy" / WEIGHTS, root / "decoy.safetensors")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    return root, inputs, expected, forward(model, inputs)


def load(folder, tier: str, spill=None):
    return offload_core.from_pretrained(folder, enable_layerwise_offload=True, backend=chaos_backend(),
                                        host_memory=TIERS[tier], offload_folder=spill)


def assert_refused(folder, tier: str, match: str, tmp_path) -> CheckpointError:
    """from_pretrained refuses with a CheckpointError matching ``match``, leaving no offload
    thread, no descriptor of the folder's files and no spill file."""
    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(CheckpointError, match=match) as refused:
        load(folder, tier, spill=tmp_path / "spill")
    assert {t.name for t in threading.enumerate()} <= threads
    assert descriptors_under(folder) == []
    assert not (tmp_path / "spill").exists() or list((tmp_path / "spill").iterdir()) == []
    return refused.value


def assert_exact(folder, tier: str, wan) -> None:
    _, inputs, expected, output = wan
    handle = load(folder, tier)
    try:
        state = handle.target.state_dict()
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
        assert torch.equal(forward(handle.target, inputs), output)
    finally:
        handle.disable()


def tensors(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def by_offset(header: dict) -> list[str]:
    return sorted(tensors(header), key=lambda k: header[k]["data_offsets"])


# -- headers: (what is done to the single file, what the refusal says) -----------------------
def _set(field, value, which=0):
    def change(header, data):
        header[by_offset(header)[which]][field] = value
        return header, data, None
    return change


def _header_text(text: bytes, length=None):
    return lambda header, data: (text, data, length)


def _length(length):
    return lambda header, data: (header, data, length)


def _into_header(header, data):  # the first tensor's bytes moved to start inside the header
    first = by_offset(header)[0]
    begin, end = header[first]["data_offsets"]
    header[first]["data_offsets"] = [begin - 16, end - 16]
    return header, data, None


def _overlap(header, data):  # the second tensor pointed at the first one's bytes
    first, second = by_offset(header)[:2]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])
    header[second]["shape"], header[second]["dtype"] = header[first]["shape"], header[first]["dtype"]
    return header, data, None


def _past_the_end(header, data):  # the file cut short inside the last tensor
    return header, data[:-8], None


def _trailing(header, data):
    return header, data + b"\0" * 8, None


def _gap(header, data):  # the last tensor moved 8 bytes on, the file grown to hold it
    last = by_offset(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 8, end + 8]
    return header, data + b"\0" * 8, None


def _duplicate(header, data):
    first = by_offset(header)[0]
    text = json.dumps(header).encode()
    entry = json.dumps({first: header[first]}).encode()[1:-1]
    return text[:-1] + b", " + entry + b"}", data, None


def _no_shape(header, data):
    del header[by_offset(header)[0]]["shape"]
    return header, data, None


def _metadata(value):
    def change(header, data):
        header["__metadata__"] = value
        return header, data, None
    return change


#: refused although the safetensors library reads them (which of the two entries is meant is a guess)
STRICTER = {"a name twice"}

HEADERS = {
    "length 0": (_length(0), "header length is 0"),
    "absurd length": (_length(2**40), "above the 100000000"),
    "length past the file": (lambda h, d: (h, d, len(json.dumps(h)) + len(d) + 1), "has only"),
    "not UTF-8": (_header_text(b'{"\xff": 1}'), "not UTF-8"),
    "empty": (_header_text(b"   "), "not valid JSON"),
    "a list": (_header_text(b"[]"), "JSON list"),
    "NaN": (_header_text(b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}'), "not valid JSON"),
    "a name twice": (_duplicate, "given twice"),
    "metadata of numbers": (_metadata({"format": 1}), "__metadata__"),
    "half a surrogate pair": (_metadata({"format": "\ud800"}), "unpaired surrogate"),
    "no shape": (_no_shape, "has no shape"),
    "unknown dtype": (_set("dtype", "F31"), "does not define"),
    "negative dimension": (_set("shape", [-1, 2]), "non-negative integers"),
    "boolean dimension": (_set("shape", [True]), "non-negative integers"),
    "three offsets": (_set("data_offsets", [0, 4, 8]), "two non-negative integers"),
    "ends before it begins": (_set("data_offsets", [8, 4]), "ends before it begins"),
    "offsets into the header": (_into_header, "non-negative integers"),
    "wrong byte length": (_set("shape", [1]), "spans .* bytes, but shape"),
    "two tensors sharing bytes": (_overlap, "overlaps"),
    "offsets past the end": (_past_the_end, "past the end"),
    "a gap": (_gap, "belong to no tensor"),
    "trailing bytes": (_trailing, "belong to no tensor"),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", HEADERS)
def test_a_header_safetensors_refuses_is_refused_naming_the_file_before_anything_is_enabled(case, tier, wan,
                                                                                          tmp_path):
    root = wan[0]
    folder = tmp_path / "model"
    copy_folder(root / "single", folder)
    path = folder / WEIGHTS
    header, data = read_header(path)
    change, match = HEADERS[case]
    header, data, length = change(header, data)
    write(path, header, data, length)
    if case not in STRICTER:
        with pytest.raises(Exception):  # the safetensors library refuses it as well
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
    refused = assert_refused(folder, tier, match, tmp_path)
    assert str(path) in str(refused)


def test_the_refusal_names_the_tensor(wan, tmp_path):
    folder = tmp_path / "model"
    copy_folder(wan[0] / "single", folder)
    header, data = read_header(folder / WEIGHTS)
    first, second = by_offset(header)[:2]
    header, data, _ = _overlap(header, data)
    write(folder / WEIGHTS, header, data)
    refused = assert_refused(folder, "ram", "overlaps", tmp_path)
    assert repr(first) in str(refused) and repr(second) in str(refused)


def test_a_tensor_of_another_shape_than_the_config_is_refused_naming_both(wan, tmp_path):
    folder = tmp_path / "model"
    copy_folder(wan[0] / "single", folder)
    header, data = read_header(folder / WEIGHTS)
    key = next(k for k in by_offset(header) if len(header[k]["shape"]) == 2 and len(set(header[k]["shape"])) == 2)
    header[key]["shape"] = header[key]["shape"][::-1]
    write(folder / WEIGHTS, header, data)
    refused = assert_refused(folder, "ram", "as configured needs", tmp_path)
    assert repr(key) in str(refused)


def test_a_weight_the_checkpoint_lacks_is_refused_naming_it(wan, tmp_path):
    folder = tmp_path / "model"
    copy_folder(wan[0] / "single", folder)
    header, data = read_header(folder / WEIGHTS)
    key = by_offset(header)[0]
    header["renamed"] = header.pop(key)
    write(folder / WEIGHTS, header, data)
    refused = assert_refused(folder, "ram", "no tensor", tmp_path)
    assert repr(key) in str(refused) and WEIGHTS in str(refused)


def test_a_model_diffusers_loads_with_a_weight_left_on_meta_is_refused(tmp_path):
    """Weights that are not safetensors are diffusers' to read; a weight they lack, which
    diffusers leaves on the meta device, is refused rather than enabled."""
    model, _ = tiny_wan(seed=0)
    model.save_pretrained(tmp_path / "model", safe_serialization=False)
    path = next((tmp_path / "model").glob("*.bin"))
    state = torch.load(path, weights_only=True)
    key = sorted(state)[0]
    del state[key]
    torch.save(state, path)
    refused = assert_refused(tmp_path / "model", "ram", "has no tensor", tmp_path)
    assert repr(key) in str(refused)


ACCEPTED = {
    "whitespace around the header": lambda h, d: (b"  " + json.dumps(h).encode() + b"    ", d),
    "metadata": lambda h, d: ({"__metadata__": {"format": "pt", "note": "x"}, **h}, d),
    "null metadata": lambda h, d: ({"__metadata__": None, **h}, d),
    "an unknown field": lambda h, d: ({**h, by_offset(h)[0]: {**h[by_offset(h)[0]], "extra": [1]}}, d),
    "an empty tensor at the end": lambda h, d: ({**h, "unused": {"dtype": "F32", "shape": [0, 3],
                                                                 "data_offsets": [len(d), len(d)]}}, d),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", ACCEPTED)
def test_what_safetensors_accepts_loads_exactly(case, tier, wan, tmp_path):
    folder = tmp_path / "model"
    copy_folder(wan[0] / "single", folder)
    header, data = ACCEPTED[case](*read_header(folder / WEIGHTS))
    write(folder / WEIGHTS, header, data)
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        assert set(f.keys()) >= set(wan[2])
    assert_exact(folder, tier, wan)


# -- paths ------------------------------------------------------------------------------------
def _escape(kind: str, folder, root) -> str:
    """A shard name of the index that reaches ``root``'s decoy checkpoint."""
    if kind == "dot-dot":
        return "../decoy.safetensors"
    if kind == "dot-dot inside a path":
        return "sub/../../decoy.safetensors"
    if kind == "absolute":
        return str(root / "decoy.safetensors")
    os.symlink(root / "decoy.safetensors", folder / "link.safetensors")
    return "link.safetensors"


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("kind", ["dot-dot", "dot-dot inside a path", "absolute", "a link out"])
def test_an_index_naming_a_file_outside_the_folder_is_refused_and_the_file_never_opened(kind, tier, wan, tmp_path):
    root = wan[0]
    folder = root / f"escape-{kind.replace(' ', '-')}-{tier}"  # beside the decoy: ../decoy.safetensors reaches it
    copy_folder(root / "sharded", folder)
    index = json.loads((folder / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    escape = _escape(kind, folder, root)
    index["weight_map"] = {k: escape if v == shard else v for k, v in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))
    reads = Reads([root / "decoy.safetensors"])
    try:
        with reads:
            refused = assert_refused(folder, tier, "outside|not a path", tmp_path)
        assert str(root / "decoy.safetensors") not in reads.opened
        assert reads.touched() == []
    finally:
        reads.close()
    assert str(INDEX) in str(refused) and escape in str(refused)


INDEXES = {
    "weight_map missing": ({"metadata": {}}, "weight_map must be"),
    "weight_map a list": ({"weight_map": []}, "weight_map must be"),
    "a shard name that is a number": ({"weight_map": {"a": 1}}, "weight_map must be"),
    "a shard that is not there": ({"weight_map": {"a": "missing.safetensors"}}, "not a file"),
    "an empty shard name": ({"weight_map": {"a": ""}}, "not a file name"),
    "half a surrogate pair": ({"weight_map": {"a": "\ud800.safetensors"}}, "not a file name"),
}


@pytest.mark.parametrize("case", INDEXES)
def test_a_malformed_index_is_refused(case, wan, tmp_path):
    folder = tmp_path / "model"
    copy_folder(wan[0] / "sharded", folder)
    index, match = INDEXES[case]
    (folder / INDEX).write_text(json.dumps(index))
    refused = assert_refused(folder, "ram", match, tmp_path)
    assert INDEX in str(refused)


def test_links_inside_the_folder_and_a_linked_folder_load_exactly(wan, tmp_path):
    folder = tmp_path / "model"
    copy_folder(wan[0] / "sharded", folder)
    index = json.loads((folder / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    os.rename(folder / shard, folder / "real.safetensors")
    os.symlink("real.safetensors", folder / shard)
    os.symlink(folder, tmp_path / "linked")
    assert_exact(tmp_path / "linked", "disk", wan)


def test_a_hub_cache_snapshot_whose_files_link_into_its_blobs_loads_exactly(wan, tmp_path):
    entry = tmp_path / "models--tiny--wan"
    snapshot = entry / "snapshots" / "0123abc"
    (entry / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(wan[0] / "sharded"):
        blob = entry / "blobs" / f"blob-{name}"
        blob.write_bytes((wan[0] / "sharded" / name).read_bytes())
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot / name)
    assert_exact(snapshot, "ram", wan)


CLASSES = {
    "a function": ("is_torch_available", "a function"),
    "a scheduler": ("DDPMScheduler", "not a diffusers model class"),
    "a module": ("logging", "not a diffusers model class"),
    "nothing": ("NoSuchModel", "is nothing"),
    "not a name": (["WanTransformer3DModel"], "is nothing"),
}


@pytest.mark.parametrize("case", CLASSES)
def test_a_config_naming_anything_but_a_model_class_is_refused(case, wan, tmp_path):
    folder = tmp_path / "model"
    copy_folder(wan[0] / "single", folder)
    config = json.loads((folder / "config.json").read_text())
    name, match = CLASSES[case]
    config["_class_name"] = name
    (folder / "config.json").write_text(json.dumps(config))
    refused = assert_refused(folder, "ram", match, tmp_path)
    assert "config.json" in str(refused)


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    from offload_core.tiny import build_pipeline

    folder = tmp_path_factory.mktemp("pipeline") / "wan"
    build_pipeline("wan2.2-t2v").pipe.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("change", ["a component out of the folder", "a component class that is a function",
                                    "a pipeline class that is a model"])
def test_a_model_index_reaching_outside_or_naming_no_loadable_class_is_refused(change, pipeline_folder, tmp_path):
    folder = tmp_path / "pipe" / "wan"
    copy_folder(pipeline_folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    if change == "a component out of the folder":
        copy_folder(folder / "transformer", tmp_path / "pipe" / "outside")
        index["../outside"] = index.pop("transformer")
        watched, match = [tmp_path / "pipe" / "outside" / WEIGHTS], "through '..'"
    elif change == "a component class that is a function":
        index["scheduler"] = ["diffusers", "is_torch_available"]
        watched, match = [], "a function"
    else:
        index["_class_name"] = "WanTransformer3DModel"
        watched, match = [], "not a diffusers pipeline class"
    (folder / "model_index.json").write_text(json.dumps(index))
    reads = Reads(watched)
    try:
        with reads:
            assert_refused(folder, "ram", match, tmp_path)
        assert reads.touched() == []
        assert not any(p.startswith(str(tmp_path / "pipe" / "outside")) for p in reads.opened)
    finally:
        reads.close()


def test_a_transformers_index_reaching_outside_is_refused_before_transformers_reads_it(wan, tmp_path):
    from offload_core.tiny import encoders as enc
    from offload_core.tiny import tokenizers as tok

    with enc.seeded(0):
        encoder = enc.t5_encoder(tok.t5_tokenizer())
    folder = tmp_path / "encoder"
    encoder.save_pretrained(folder, max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    os.rename(folder / shard, tmp_path / "outside.safetensors")
    index["weight_map"] = {k: "../outside.safetensors" if v == shard else v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    reads = Reads([tmp_path / "outside.safetensors"])
    try:
        with reads:
            assert_refused(folder, "ram", "not a path", tmp_path)
        assert reads.touched() == []
    finally:
        reads.close()


def test_a_transformers_header_is_checked_before_transformers_reads_it(tmp_path):
    from offload_core.tiny import encoders as enc
    from offload_core.tiny import tokenizers as tok

    with enc.seeded(0):
        encoder = enc.t5_encoder(tok.t5_tokenizer())
    folder = tmp_path / "encoder"
    encoder.save_pretrained(folder)
    path = folder / "model.safetensors"
    header, data = read_header(path)
    write(path, header, data[:-4])
    assert_refused(folder, "ram", "past the end", tmp_path)


def test_a_header_length_that_is_not_8_bytes_is_refused(wan, tmp_path):
    folder = tmp_path / "model"
    copy_folder(wan[0] / "single", folder)
    (folder / WEIGHTS).write_bytes(struct.pack("<I", 7))
    assert_refused(folder, "ram", "shorter than the 8-byte header length", tmp_path)
