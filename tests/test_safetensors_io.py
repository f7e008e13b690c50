"""Safetensors written tensor by tensor: readable by the safetensors library, and saving a
checkpoint builds no in-memory copy of the state (tracemalloc sees NumPy's buffers and
Python's bytes objects, so a whole-file ``bytes`` would show as a peak of its size)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pockengine.finetune.run_folder import checkpoint
from pockengine.safetensors_io import append_tensors, write_safetensors_to


def test_every_dtype_and_layout_round_trips(tmp_path: Path) -> None:
    tensors = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "scalar": np.asarray(3.5),
        "bool": np.array([True, False, True]),
        "transposed": np.arange(12, dtype=np.int64).reshape(3, 4).T,
        "empty": np.zeros((0, 3), np.float32),
        "codes": np.arange(5, dtype=np.uint8),
        "half": np.linspace(0, 1, 4, dtype=np.float16),
    }
    path = tmp_path / "t.safetensors"
    with path.open("wb") as f:
        write_safetensors_to(f, tensors, {"note": "x"})
    back = load_file(path)
    for name, want in tensors.items():
        assert back[name].dtype == want.dtype and back[name].shape == want.shape, name
        np.testing.assert_array_equal(back[name], want, err_msg=name)


def test_an_unsupported_dtype_is_named(tmp_path: Path) -> None:
    with (tmp_path / "t").open("wb") as f, pytest.raises(TypeError, match="c64"):
        write_safetensors_to(f, {"c64": np.zeros(2, np.complex64)})


def test_saving_a_checkpoint_holds_no_copy_of_the_state(tmp_path: Path) -> None:
    big = np.ones((2048, 4096), np.float32)  # 32 MiB
    ckpt = checkpoint.Checkpoint(
        params={"w": big}, optimizer={"m": big * 0}, order=np.arange(10), counters={"step": 1},
        config={}, scheme={},
    )  # fmt: skip
    tracemalloc.start()
    try:
        checkpoint.save(tmp_path / "c.safetensors", ckpt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"saving allocated {peak / 2**20:.1f} MiB"
    loaded = checkpoint.load(tmp_path / "c.safetensors")
    np.testing.assert_array_equal(loaded.params["w"], big)
    assert loaded.counters == {"step": 1}


def test_append_tensors_keeps_every_tensor_and_the_metadata(tmp_path: Path) -> None:
    """Tensors added after a file's own (the pooler added to a written encoder): the old
    ones are copied through byte for byte, without loading them."""
    from safetensors import safe_open

    own = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.int64)}
    path = tmp_path / "m.safetensors"
    with path.open("wb") as f:
        write_safetensors_to(f, own, {"format": "pt"})
    extra = {"pooler.w": np.ones((2, 2), np.float16), "pooler.t": np.arange(4.0).reshape(2, 2).T}
    append_tensors(path, extra)
    got = load_file(str(path))
    assert got.keys() == {*own, *extra}
    for name, want in {**own, **extra}.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        assert got[name].dtype == want.dtype
    with safe_open(str(path), "np") as f:
        assert f.metadata() == {"format": "pt"}
    assert not path.with_name(path.name + ".tmp").exists()


def test_lazy_tensors_read_one_tensor_a_lookup(tmp_path: Path) -> None:
    """``LazyTensors`` gives what ``safetensors`` loads, each value a fresh array read
    on lookup; a file cut short is a ValueError naming the tensor."""
    from safetensors.numpy import load_file

    from pockengine.safetensors_io import LazyTensors

    path = tmp_path / "w.safetensors"
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array(7, np.int64),
               "c": np.zeros((0, 2), np.float16)}  # fmt: skip
    with path.open("wb") as f:
        write_safetensors_to(f, tensors)
    lazy = LazyTensors(path)
    want = load_file(str(path))
    assert sorted(lazy) == sorted(want) and len(lazy) == 3
    for name, value in want.items():
        got = lazy[name]
        np.testing.assert_array_equal(got, value)
        assert got.dtype == value.dtype and got.shape == value.shape
    first = lazy["a"]
    first[0, 0] = 99.0
    assert lazy["a"][0, 0] == 0.0  # not a view of something kept
    with pytest.raises(KeyError):
        lazy["missing"]
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 8)
    with pytest.raises(ValueError, match="b is cut short"):
        LazyTensors(path)["b"]


def _file_rss_kib() -> int:
    """The resident pages mapped from files (``RssFile``): what paging out hands back. The
    heap's pages (``RssAnon``) follow the process's glibc settings, which a torch step
    compiled earlier in the same process may have fixed (the step heap)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile")


def test_pages_of_a_mapped_file_are_handed_back_after_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within ``pages_out_after_write`` a memory-mapped weight read to be written (the
    compile child's step artifact and skeleton) leaves the resident memory block by block
    (``_libc.page_out``), and the file written is the same bytes."""
    from pockengine import _libc, safetensors_io
    from pockengine.safetensors_io import all_zero, pages_out_after_write, write_streamed_to

    source = tmp_path / "weights.bin"
    values = np.random.default_rng(0).standard_normal(6 << 20).astype(np.float32)  # 24 MiB
    values.tofile(source)
    mapped = np.memmap(source, dtype=np.float32, mode="r", shape=values.shape)
    spec = {"w": np.broadcast_to(np.zeros((), np.float32), values.shape)}
    plain, paged = tmp_path / "plain.safetensors", tmp_path / "paged.safetensors"
    with plain.open("wb") as f:
        write_streamed_to(f, spec, lambda _: values)
    before = _file_rss_kib()
    blocks: list[int] = []
    real = _libc.page_out
    monkeypatch.setattr(safetensors_io, "page_out", lambda a: blocks.append(a.nbytes) or real(a))
    with pages_out_after_write(), paged.open("wb") as f:
        assert not all_zero(mapped)  # read (a first block is not zero), handed back
        write_streamed_to(f, spec, lambda _: mapped)
    assert plain.read_bytes() == paged.read_bytes()
    assert sum(blocks[1:]) == mapped.nbytes and max(blocks) <= safetensors_io._BLOCK
    if not real(np.zeros(1 << 16, np.uint8)):
        pytest.skip("this kernel refuses MADV_PAGEOUT (Linux 5.4+)")
    assert _file_rss_kib() - before < 8 << 10  # 24 MiB read, at most one block left resident
    np.testing.assert_array_equal(mapped[::4096], values[::4096])  # values unchanged
    with paged.open("wb") as f:  # outside: nothing is handed back
        blocks.clear()
        write_streamed_to(f, spec, lambda _: mapped)
    assert not blocks
