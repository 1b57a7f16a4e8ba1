"""`ficoco show` (issue 16): the picture marks exactly the tokens in the handle's records, in
every family, read back from the figure objects; the command's errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import ficoco
from ficoco import accounting as acc
from ficoco.api import profile_of
from ficoco.profiling.show import Layout, picture_inputs, show_data
from ficoco.sweep.figures import token_figure


@pytest.fixture(scope="module")
def picture(tmp_path_factory: pytest.TempPathFactory) -> str:
    from PIL import Image

    path = tmp_path_factory.mktemp("show") / "picture.png"
    gradient = np.linspace(0, 255, 120 * 90 * 3).reshape(90, 120, 3).astype(np.uint8)
    Image.fromarray(gradient).save(path)
    return str(path)


def cells_of(figure, gid: str) -> dict[int, set[tuple[float, float, float, float]]]:
    """Per panel (axes index), the (row, col, height, width) of every rectangle of collection `gid`."""
    found: dict[int, set] = {}
    for index, ax in enumerate(figure.axes):
        for collection in ax.collections:
            if collection.get_gid() != gid:
                continue
            for path in collection.get_paths():
                (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
                found.setdefault(index, set()).add((round(y0), round(x0), round(y1 - y0), round(x1 - x0)))
    return found


def links_of(figure, panel: int) -> set[tuple[float, ...]]:
    return {tuple(np.round(np.asarray(segment).flatten(), 3)) for c in figure.axes[panel].collections
            if c.get_gid() == "links" for segment in c.get_segments()}


def records_and_show(name: str, variant: str, keep: int, image: str | None):
    model = ficoco.build_model(name, dtype="fp32")
    layout = Layout(model)
    inputs, pictures = picture_inputs(model, layout, image)
    arch = acc.architecture(profile_of(model, name))
    schedule = acc.resolve_schedule(arch, variant, acc.CountOptions(), keep=keep)
    # The handle's records, from a run of our own on the same inputs.
    with torch.inference_mode(), ficoco.apply(model, variant, schedule=schedule) as handle:
        model(**inputs, use_cache=False)
        records = list(handle.records)
    data = show_data(model, variant, schedule, inputs, layout, pictures)
    data.update(model=name, budget=f"keep {keep}", random_weights=True, image=image)
    return records, data


@pytest.mark.parametrize("variant", ["v", "l"])
def test_llava_show_marks_exactly_the_recorded_tokens_and_their_merges(variant: str, picture: str) -> None:
    records, data = records_and_show("llava-tiny", variant, 16, picture)
    side = 8  # llava-tiny: 8 x 8 patches, L's span offsets are the same grid, row-major
    assert [s["layer"] for s in data["steps"]] == [r.layer for r in records]
    for k, record in enumerate(records):
        figure = token_figure(data, layer=record.layer)
        kept = {(g // side, g % side, 1, 1) for g in record.kept[0].tolist()}
        discarded = {(g // side, g % side, 1, 1) for g in record.discarded[0].tolist()}
        earlier = {(g // side, g % side, 1, 1) for r in records[:k] for g in r.discarded[0].tolist()}
        assert cells_of(figure, "kept") == {0: kept}
        assert cells_of(figure, "discarded") == {0: discarded}
        assert cells_of(figure, "removed_before") == ({0: earlier} if earlier else {})
        # Every discarded token is linked to the kept token the record says it went into.
        pairs = zip(record.discarded[0].tolist(), record.merged_into[0].tolist(), strict=True)
        expected = {(s % side + .5, s // side + .5, t % side + .5, t // side + .5) for s, t in pairs}
        assert links_of(figure, 0) == expected
        assert set(record.merged_into[0].tolist()) <= set(record.kept[0].tolist())
    sheet = token_figure(data)
    assert sum(1 for ax in sheet.axes if ax.get_gid()) == len(records) + 1  # every layer and the end
    assert "RANDOM WEIGHTS" in sheet._suptitle.get_text()


def test_qwen2_vl_show_draws_patches_in_v_and_2x2_groups_in_l(picture: str) -> None:
    records, data = records_and_show("qwen2-vl-tiny", "v", 8, picture)
    cols = data["panels"][0]["cols"]
    figure = token_figure(data, layer=records[0].layer)
    assert cells_of(figure, "discarded") == {0: {(g // cols, g % cols, 1, 1) for g in records[0].discarded[0].tolist()}}
    # Groups leave whole: every discarded patch's 2 x 2 group is discarded with it.
    for row, col, _, _ in cells_of(figure, "discarded")[0]:
        top, left = row - row % 2, col - col % 2
        group = {(top + i, left + j, 1, 1) for i in (0, 1) for j in (0, 1)}
        assert group <= cells_of(figure, "discarded")[0]
    assert any(c.get_gid() == "groups" for c in figure.axes[0].collections)
    records, data = records_and_show("qwen2-vl-tiny", "l", 8, picture)
    groups_w = data["panels"][0]["cols"] // 2
    figure = token_figure(data, layer=records[0].layer)
    expected = {(o // groups_w * 2, o % groups_w * 2, 2, 2) for o in records[0].discarded[0].tolist()}
    assert cells_of(figure, "discarded") == {0: expected}


def test_llava_next_show_places_the_base_view_and_the_crops(picture: str) -> None:
    records, data = records_and_show("llava-next-tiny", "v", 33, picture)
    assert [p["name"] for p in data["panels"]] == ["base view", "2x2 crops"]
    side = data["panels"][0]["rows"]
    record = records[0]
    figure = token_figure(data, layer=record.layer)
    kept = cells_of(figure, "kept")
    assert kept[0] == {(g // side, g % side, 1, 1) for g in record.kept[0].tolist()}  # item 0: the base view
    crop = 3  # the last crop: bottom right of the 2 x 2 grid
    assert {(side + g // side, side + g % side, 1, 1) for g in record.kept[1 + crop].tolist()} <= kept[1]
    assert len(kept[1]) == record.kept[1:].numel()
    assert any(c.get_gid() == "crops" for c in figure.axes[1].collections)


def test_video_llava_show_draws_every_frame(picture: str) -> None:
    records, data = records_and_show("video-llava-tiny", "v", 40, picture)
    frames = len(data["panels"])
    figure = token_figure(data, layer=records[0].layer)
    kept = cells_of(figure, "kept")
    assert len(kept) == frames == records[0].kept.shape[0]
    side = data["panels"][0]["rows"]
    for frame in range(frames):
        assert kept[frame] == {(g // side, g % side, 1, 1) for g in records[0].kept[frame].tolist()}


def test_show_command_writes_the_picture_and_the_same_data_as_json(cli, picture: str, tmp_path: Path) -> None:
    from PIL import Image

    out, report = tmp_path / "tokens.png", tmp_path / "tokens.json"
    code, _, err = cli(*["show", "--model", "llava-tiny", "--variant", "v", "--keep", "16", "--image", picture,
                        "--out", str(out), "--json", str(report), "--dtype", "fp32"])
    assert code == 0, err
    with Image.open(out) as png:
        png.verify()
    data = json.loads(report.read_text())
    assert data["schema"] == "ficoco.show/1" and data["random_weights"] and data["image"] == picture
    records, _ = records_and_show("llava-tiny", "v", 16, picture)
    assert [s["records"]["discarded"] for s in data["steps"]] == [r.discarded.tolist() for r in records]
    assert [s["records"]["merged_into"] for s in data["steps"]] == [r.merged_into.tolist() for r in records]
    code, _, err = cli(*["show", "--model", "llava-tiny", "--variant", "l", "--keep", "16", "--layer", "2",
                        "--out", str(tmp_path / "one.svg")])
    assert code == 0, err
    assert (tmp_path / "one.svg").read_text().lstrip().startswith("<?xml")
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []  # the pictures were saved and nothing stays open


def test_show_refuses_mistakes_in_one_line(cli, picture: str, tmp_path: Path) -> None:
    cases = [
        (["show", "--model", "llava-tiny", "--keep", "16", "--out", str(tmp_path / "x.txt")], "--out"),
        (["show", "--model", "llava-tiny", "--keep", "16", "--layer", "0", "--out", str(tmp_path / "x.png")],
         "--layer"),
        (["show", "--model", "llava-tiny", "--out", str(tmp_path / "x.png")], "--keep"),
        (["show", "--model", "llava-tiny", "--variant", "vanilla", "--keep", "8", "--out", str(tmp_path / "x.png")],
         "--variant"),
        (["show", "--model", "llava-tiny", "--keep", "16", "--image", str(tmp_path / "missing.png"),
          "--out", str(tmp_path / "x.png")], "--image"),
    ]
    for argv, named in cases:
        code, _, err = cli(*argv)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], (argv, err)
