import hashlib
import pathlib

from PIL import Image

from lightray.data.demo import SHAPES, generate_demo


def digest(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.jpg"))}


def test_same_seed_gives_the_same_bytes(tmp_path):
    a = generate_demo(tmp_path / "a", seed=3, num_classes=10, train_per_class=4, val_per_class=2, processes=1)
    b = generate_demo(tmp_path / "b", seed=3, num_classes=10, train_per_class=4, val_per_class=2, processes=2)
    assert digest(a) == digest(b) and len(digest(a)) == 60


def test_another_seed_gives_other_images(tmp_path):
    a = generate_demo(tmp_path / "a", seed=1, num_classes=10, train_per_class=2, val_per_class=1, processes=1)
    b = generate_demo(tmp_path / "b", seed=2, num_classes=10, train_per_class=2, val_per_class=1, processes=1)
    assert set(digest(a).values()).isdisjoint(digest(b).values())


def test_imagefolder_layout_with_varied_sizes_and_real_jpegs(tmp_path):
    root = generate_demo(tmp_path, seed=0, num_classes=10, train_per_class=12, val_per_class=3, processes=1)
    assert sorted(p.name for p in (root / "train").iterdir()) == sorted(SHAPES[:10])
    sizes = set()
    for p in (root / "train").rglob("*.jpg"):
        with Image.open(p) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            sizes.add(im.size)
    assert len(sizes) > 50  # varied sizes
    assert any(w != h for w, h in sizes)  # not all square
    assert len(list((root / "val").rglob("*.jpg"))) == 30


def test_classes_differ_by_shape_not_by_colour(tmp_path):
    """Mean colour carries no class signal: per-class mean colours are close to each other."""
    import numpy as np

    root = generate_demo(tmp_path, seed=0, num_classes=4, train_per_class=40, val_per_class=1, processes=1)
    means = []
    for cls in sorted((root / "train").iterdir()):
        px = [np.asarray(Image.open(p)).reshape(-1, 3).mean(0) for p in cls.glob("*.jpg")]
        means.append(np.mean(px, axis=0))
    spread = np.ptp(np.stack(means), axis=0)
    assert spread.max() < 40, spread


def test_the_writer_processes_are_started_fresh_not_forked_from_the_caller(tmp_path):
    """The demo is written from a Ray driver or worker, whose threads a fork would copy mid-flight (a forked
    writer crashed with SIGSEGV in Ray's signal handler, CI 2026-12-07): the pool's processes must be new
    interpreters. A forked child runs the caller's own command line; a writer its own, naming the module.
    Its new children are read from /proc while the pool writes, until it is done; each one's last reading counts."""
    import threading

    import psutil

    me = psutil.Process()
    before = {c.pid for c in me.children()}  # a Ray cluster this process started (CI's session cluster) is not ours
    seen: dict[int, list[str]] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for child in me.children():
                if child.pid in before:
                    continue
                try:
                    cmd = child.cmdline()
                except psutil.Error:  # gone between the listing and the read
                    continue
                if cmd:  # an exited child not yet reaped shows none
                    seen[child.pid] = cmd  # the last read: a spawned child shows the caller's until its exec
            done.wait(0.005)  # a poll, not a spin: the writers need the two cores this loop would take

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        generate_demo(tmp_path, seed=0, num_classes=10, train_per_class=12, val_per_class=3, processes=2)
    finally:
        done.set()
        watcher.join()
    assert seen, "no writer process was seen"
    writers = [cmd for cmd in seen.values() if cmd != me.cmdline()]
    assert len(writers) == len(seen), f"forked writers run the caller's command line {me.cmdline()}"
    assert all("lightray.data.demo" in " ".join(cmd) for cmd in writers), seen
