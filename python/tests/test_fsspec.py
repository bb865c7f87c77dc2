"""The ff:// protocol through fsspec, pandas, PyArrow and NumPy, against a real cluster."""

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import xarray as xr
import zarr

from freeflow.fsspec import FreeflowFileSystem


@pytest.fixture
def fs(cluster):
    return fsspec.filesystem("ff")  # found through the package's entry point


def test_the_protocol_is_registered(fs, cluster):
    assert isinstance(fs, FreeflowFileSystem)
    assert fs.client.cluster == cluster.cluster_file
    assert FreeflowFileSystem._strip_protocol("ff://a//b/") == "/a/b"
    assert FreeflowFileSystem._strip_protocol("ff:///") == "/"
    assert fs.unstrip_protocol("/a/b") == "ff:///a/b"


def test_pandas_writes_and_reads_parquet(fs, home):
    frame = pd.DataFrame(
        {
            "step": np.arange(50_000, dtype=np.int64),
            "loss": np.random.default_rng(1).random(50_000),
            "tag": [f"run-{i % 7}" for i in range(50_000)],
        }
    )
    url = f"ff://{home}/metrics.parquet"
    frame.to_parquet(url)
    assert fs.info(f"{home}/metrics.parquet")["size"] > 0
    back = pd.read_parquet(url)
    pd.testing.assert_frame_equal(back, frame)
    some = pd.read_parquet(url, columns=["loss"], filters=[("step", "<", 10)])
    assert len(some) == 10


def test_pyarrow_reads_a_dataset_of_many_files(fs, home):
    strict = fsspec.filesystem("ff", auto_mkdir=False)
    with pytest.raises(FileNotFoundError):
        strict.open(f"{home}/set/part-0.parquet", "wb")
    for part in range(3):
        table = pa.table({"part": [part] * 1000, "value": np.arange(1000) * part})
        with fs.open(f"{home}/set/part-{part}.parquet", "wb") as f:
            pq.write_table(table, f)
    dataset = ds.dataset(f"{home}/set", filesystem=fs, format="parquet")
    table = dataset.to_table()
    assert table.num_rows == 3000
    assert sorted(set(table.column("part").to_pylist())) == [0, 1, 2]


def test_numpy_arrays_through_fsspec_open(home):
    array = np.random.default_rng(5).standard_normal((300, 400)).astype(np.float32)
    with fsspec.open(f"ff://{home}/weights.npy", "wb") as f:
        np.save(f, array)
    with fsspec.open(f"ff://{home}/weights.npy", "rb") as f:
        assert np.array_equal(np.load(f), array)


def test_zarr_and_xarray_stores(home):
    grid = np.arange(10_000, dtype=np.float64).reshape(100, 100)
    group = zarr.open_group(f"ff://{home}/g.zarr", mode="w")
    group.create_array("grid", shape=grid.shape, chunks=(10, 10), dtype=grid.dtype)[:] = grid
    assert np.array_equal(zarr.open_group(f"ff://{home}/g.zarr", mode="r")["grid"][:], grid)
    data = xr.Dataset({"t": (("x", "y"), grid)}, coords={"x": np.arange(100)})
    data.to_zarr(f"ff://{home}/ds.zarr", mode="w", consolidated=False)
    back = xr.open_zarr(f"ff://{home}/ds.zarr", consolidated=False)
    assert np.array_equal(back["t"].values, grid)


def test_text_files_and_small_helpers(fs, home):
    with fsspec.open(f"ff://{home}/notes.txt", "wt", encoding="utf-8") as f:
        f.write("alpha\nbeta\n")
    with fsspec.open(f"ff://{home}/notes.txt", "rt", encoding="utf-8") as f:
        assert f.read().splitlines() == ["alpha", "beta"]
    fs.pipe_file(f"{home}/blob", b"0123456789")
    assert fs.cat_file(f"{home}/blob", start=2, end=5) == b"234"
    assert fs.size(f"{home}/blob") == 10


def test_listing_moving_copying_removing(fs, home):
    fs.mkdir(f"{home}/d/e")
    fs.pipe_file(f"{home}/d/x.bin", b"x" * 1000)
    fs.pipe_file(f"{home}/d/e/y.bin", b"y" * 10)
    listed = {i["name"]: i for i in fs.ls(f"{home}/d", detail=True)}
    assert sorted(listed) == [f"{home}/d/e", f"{home}/d/x.bin"]
    assert listed[f"{home}/d/x.bin"]["type"] == "file" and listed[f"{home}/d/x.bin"]["size"] == 1000
    assert listed[f"{home}/d/e"]["type"] == "directory"
    assert fs.ls(f"{home}/d", detail=False) == [f"{home}/d/e", f"{home}/d/x.bin"]
    assert sorted(fs.find(f"{home}/d")) == [f"{home}/d/e/y.bin", f"{home}/d/x.bin"]
    assert fs.glob(f"ff://{home}/d/*.bin") == [f"{home}/d/x.bin"]
    assert fs.du(f"{home}/d") == 1010

    fs.cp_file(f"{home}/d/x.bin", f"{home}/d/copy.bin")
    assert fs.cat_file(f"{home}/d/copy.bin") == b"x" * 1000
    fs.mv(f"{home}/d/copy.bin", f"{home}/moved.bin")
    assert not fs.exists(f"{home}/d/copy.bin") and fs.exists(f"{home}/moved.bin")

    with pytest.raises(FileNotFoundError):
        fs.info(f"{home}/d/none")
    with pytest.raises(FileExistsError):
        fs.mkdir(f"{home}/d")
    with pytest.raises(ValueError):
        fs.rm(f"{home}/d")
    fs.rm(f"{home}/d", recursive=True)
    assert not fs.exists(f"{home}/d")
    assert fs.ls(home, detail=False) == [f"{home}/moved.bin"]


def test_globs_and_missing_parents(fs, home):
    for name in ("a.bin", "b.bin", "c.txt"):
        fs.pipe_file(f"{home}/g/{name}", name.encode())
    fs.rm(f"ff://{home}/g/*.bin")
    assert fs.ls(f"{home}/g", detail=False) == [f"{home}/g/c.txt"]
    fs.cp_file(f"{home}/g/c.txt", f"{home}/new/dir/c.txt")
    fs.mv(f"{home}/new/dir/c.txt", f"{home}/other/place/c.txt")
    assert fs.cat_file(f"{home}/other/place/c.txt") == b"c.txt"
    assert not fs.exists(f"{home}/new/dir/c.txt")


def test_a_pickled_filesystem_reaches_the_same_cluster(fs, home, monkeypatch):
    import pickle

    fs.pipe_file(f"{home}/p", b"pickled")
    monkeypatch.delenv("FREEFLOW_CLUSTER")
    copy = pickle.loads(pickle.dumps(fs))
    assert copy.client.cluster == fs.client.cluster
    assert copy.cat_file(f"{home}/p") == b"pickled"
