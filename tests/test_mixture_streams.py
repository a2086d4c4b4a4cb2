"""Mixtures of streams (ledger.Mixture of ledger.stream.Stream sources): exact resume
packed and not with any workers, elastic resume, each source's own epochs, realised
shares against the ground truth, and the mixture audit."""

from __future__ import annotations

import os
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from conftest import Draws, loop_generators_with_cached_variates

import ledger
from ledger.audit import connect
from ledger.cli import main
from ledger.errors import UnsupportedArgument
from ledger.mixture import Mixture
from ledger.stream import Packer, SampleContext, ShardedSource, Stream
from ledger.testing import assert_resume_exact, batches_equal, take

CODE_ROWS = (5, 4, 3)  # 12 rows in 3 shards: the small source, repeated
PROSE_ROWS = (9, 8, 7, 6)  # 30 rows in 4 shards
EPOCH = sum(CODE_ROWS) + sum(PROSE_ROWS)  # positions per mixture epoch (the default)


def _write(folder, name: str, rows: tuple[int, ...]) -> ShardedSource:
    d = folder / name
    d.mkdir()
    k = 0
    for s, n in enumerate(rows):
        texts = [f"{name} {k + i} " + "xyz"[: (k + i) % 4] for i in range(n)]
        table = pa.table({"text": texts, "row": list(range(k, k + n))})
        pq.write_table(table, d / f"part-{s}.parquet", row_group_size=2)
        k += n
    return ShardedSource(str(d / "*.parquet"))


@pytest.fixture
def sources(tmp_path):
    return _write(tmp_path, "code", CODE_ROWS), _write(tmp_path, "prose", PROSE_ROWS)


def tokenize(record, ctx: SampleContext):
    ctx.record(flip=int(ctx.rng.integers(0, 2)))
    return np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1


def texts(rows):
    return [r["text"] for r in rows]


def mixture(sources, packing: bool, weights=None) -> Mixture:
    code, prose = sources
    packer = Packer(seq_len=8) if packing else None
    transform = tokenize if packing else None
    return Mixture(
        {
            "code": Stream(code, transform=transform, shuffle_buffer=3, packer=packer),
            "prose": Stream(prose, transform=transform, shuffle_buffer=4, packer=packer),
        },
        weights=weights or {"code": 0.6, "prose": 0.4},
    )


def loader(sources, root, packing: bool, workers: int, seed: int = 5) -> ledger.DataLoader:
    return ledger.DataLoader(
        mixture(sources, packing),
        batch_size=3,
        shuffle=True,
        seed=seed,
        num_workers=workers,
        log=root,
        collate_fn=None if packing else texts,
    )


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_stream_mixture_resumes_exactly(sources, root, packing, workers) -> None:
    def make() -> ledger.DataLoader:
        return loader(sources, root, packing, workers)

    # 42 positions per mixture epoch: 36 batches cross two of them unpacked (three
    # packed), and the small source's epochs many times.
    at = None if workers == 0 else [3, 12, 15, 27]
    assert assert_resume_exact(make, batches=36, every=3, resume_at=at) == (12 if at is None else 4)


def served(current: ledger.DataLoader, batches: int) -> list:
    """``batches`` batches, then a commit (the lineage holds them)."""
    out = list(take(current, batches))
    current.state_dict()
    return out


def _lineage(root: str) -> tuple[list[tuple], int]:
    con = connect(root)
    rows = con.execute(
        """
        SELECT epoch, position, CAST(source AS VARCHAR), sample_id, worker, kind,
               token_start, token_end, length
        FROM lineage WHERE kind IN ('sample', 'span') ORDER BY batch, worker
        """
    ).fetchall()
    last = con.execute("SELECT max(epoch) FROM lineage").fetchone()[0]
    return rows, int(last)


def _check_positions_and_sources(mix: Mixture, seed: int, rows: list[tuple], last: int) -> None:
    """Each finished mixture epoch: every position once, of the source the mixture's
    counter-based function gives; every packed sample's tokens once."""
    firsts = [r for r in rows if r[5] == "sample" or r[6] == 0]
    for epoch in range(last):
        mine = [r for r in firsts if r[0] == epoch]
        positions = np.array([r[1] for r in mine], np.int64)
        assert sorted(positions.tolist()) == list(range(EPOCH)), epoch
        truth = mix.sources_at(seed, positions + epoch * EPOCH)
        assert [r[2] for r in mine] == [mix.names[s] for s in truth.tolist()]
    spans = [r for r in rows if r[5] == "span" and r[0] < last]
    if spans:
        tokens: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for r in spans:
            tokens.setdefault((r[0], r[1]), []).append((r[6], r[7], r[8]))
        assert len(tokens) == EPOCH * last
        for key, parts in tokens.items():
            length = parts[0][2]
            covered = sorted((a, b) for a, b, _ in parts)
            assert covered[0][0] == 0 and covered[-1][1] == length, key
            assert all(x[1] == y[0] for x, y in pairwise(covered)), key


@pytest.mark.parametrize("packing", [False, True])
def test_each_position_once_of_its_source_and_each_source_epoch_once(
    sources, root, packing
) -> None:
    assert served(loader(sources, root, packing, 2, seed=7), 60)
    rows, last = _lineage(root)
    assert last >= 2
    mix = mixture(sources, packing)
    _check_positions_and_sources(mix, 7, rows, last)
    # Each source keeps its own epochs: every lane serves its share of each source epoch
    # once before the next, so per source the counts of its samples differ by at most 1
    # per lane (two logical workers here) and every sample is served.
    firsts = [r for r in rows if r[5] == "sample" or r[6] == 0]
    for name, n in (("code", sum(CODE_ROWS)), ("prose", sum(PROSE_ROWS))):
        counts = np.bincount([r[3] for r in firsts if r[2] == name], minlength=n)
        assert counts.size == n
        assert counts.min() >= 1 and counts.max() - counts.min() <= 2, (name, counts)
    code = sum(1 for r in firsts if r[2] == "code")
    assert code >= 3 * sum(CODE_ROWS)  # the small source repeated


def test_realised_shares_equal_the_ground_truth_and_audit_passes(sources, root) -> None:
    served(loader(sources, root, False, 2, seed=11), 40)
    rows, _ = _lineage(root)
    mix = mixture(sources, False)
    # Ground truth: the mixture's counter-based source of each served position.
    got = {"code": 0, "prose": 0}
    want = {"code": 0, "prose": 0}
    for r in rows:
        got[r[2]] += 1
        want[mix.names[int(mix.sources_at(11, np.array([r[0] * EPOCH + r[1]]))[0])]] += 1
    assert got == want
    # Whole blocks realise the weights exactly: the first 1000 positions hold 600 code.
    assert int((mix.sources_at(11, np.arange(1000)) == 0).sum()) == 600
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0, out.output
    assert "shares within" in out.output


def test_audit_fails_a_stream_mixture_whose_shares_are_off(sources, root) -> None:
    """The check can fail: a log whose config claims other weights than it served."""
    from conftest import rewrite_run

    served(loader(sources, root, True, 0), 60)
    rewrite_run(
        root, lambda run: run["config"]["mixture"].update(targets=[{"code": 0.1, "prose": 0.9}])
    )
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture"])
    assert out.exit_code != 0, out.output
    assert "off target" in out.output


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize(
    "shapes",
    [
        [(2, 5), (0, 4)],  # workers, batches served before the next change
        [(1, 7), (3, 4), (2, 9)],  # several changes, some inside one carried epoch
    ],
)
def test_elastic_resume_serves_each_position_and_sample_once(
    sources, root, packing, shapes
) -> None:
    """Mid-epoch changes of the logical workers (num_workers; a world size change is the
    same change of shape), with buffers and packed samples in flight."""
    token = None
    for workers, batches in shapes:
        current = loader(sources, root, packing, workers)
        if token is not None:
            current.load_state_dict(token)
        list(take(current, batches))
        token = current.state_dict()
    third = loader(sources, root, packing, 3)
    third.load_state_dict(token)
    list(take(third, 2))
    inside = third.state_dict()  # a commit inside an epoch carried from the old shapes
    reference = list(take(third, 40))
    third.state_dict()
    again = loader(sources, root, packing, 3)
    again.load_state_dict(inside)
    assert all(batches_equal(a, b) for a, b in zip(take(again, 40), reference, strict=True))
    rows, last = _lineage(root)
    assert last >= 2
    _check_positions_and_sources(mixture(sources, packing), 5, rows, last)
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture"])
    assert out.exit_code == 0, out.output


def test_a_stream_mixture_refuses_what_it_cannot_mix(sources) -> None:
    from conftest import Based

    code, prose = sources
    with pytest.raises(UnsupportedArgument, match="neither a map-style dataset"):
        Mixture({"code": Stream(code), "b": object()}, weights={"code": 1, "b": 1})
    with pytest.raises(UnsupportedArgument, match="is a Mixture"):
        inner = Mixture({"b": Based(3, 0)}, weights={"b": 1})
        Mixture({"code": Stream(code), "inner": inner}, weights={"code": 1, "inner": 1})
    with pytest.raises(ValueError, match="share one packer"):
        Mixture(
            {"code": Stream(code, packer=Packer(8)), "prose": Stream(prose)},
            weights={"code": 1, "prose": 1},
        )
    mix = mixture(sources, False)
    with pytest.raises(TypeError, match="no random access"):
        mix[0]


@pytest.mark.parametrize("packing", [False, True])
def test_a_new_phase_changes_the_batch_size_and_refuses_a_changed_kept_source(
    sources, root, packing
) -> None:
    from ledger.errors import ConfigMismatch

    def make(batch_size: int, weights=None) -> ledger.DataLoader:
        return ledger.DataLoader(
            mixture(sources, packing, weights),
            batch_size=batch_size,
            seed=5,
            log=root,
            collate_fn=None if packing else texts,
        )

    def rows(batches: list) -> list:  # samples (or packed sequences) in order
        if packing:
            return [seq.tolist() for b in batches for seq in b["tokens"]]
        return [x for b in batches for x in b]

    first = make(3)
    list(take(first, 4))
    token = first.state_dict()
    reference = rows(list(take(first, 20)))  # 60 samples or sequences, crossing epochs
    with pytest.raises(ConfigMismatch, match="batch_size"):
        make(5).load_state_dict(token)
    wider = make(5)
    wider.load_state_dict(token, new_phase=True)
    got = rows(list(take(wider, 14)))  # an epoch's last batch may be short
    assert len(got) >= len(reference) and got[: len(reference)] == reference
    # A source kept by name keeps its stream (here: another shuffle buffer), and sources
    # change at the run's shape (here: with workers where the run had none).
    code, prose = sources
    packer = Packer(seq_len=8) if packing else None
    transform = tokenize if packing else None
    other = Mixture(
        {
            "code": Stream(code, transform=transform, shuffle_buffer=5, packer=packer),
            "prose": Stream(prose, transform=transform, shuffle_buffer=4, packer=packer),
        },
        weights={"code": 0.6, "prose": 0.4},
    )
    changed = ledger.DataLoader(other, batch_size=3, seed=5, log=root, collate_fn=texts)
    with pytest.raises(ConfigMismatch, match="mixture source 'code'"):
        changed.load_state_dict(token, new_phase=True)
    fewer = Mixture(
        {"code": Stream(code, transform=transform, shuffle_buffer=3, packer=packer)},
        weights={"code": 1.0},
        epoch_size=EPOCH,
    )
    wider = ledger.DataLoader(fewer, batch_size=3, seed=5, log=root, num_workers=2)
    with pytest.raises(ConfigMismatch, match="world_size and num_workers"):
        wider.load_state_dict(token, new_phase=True)


def test_a_rollback_skip_of_a_stream_mixture_is_exact_and_names_sources(sources, root) -> None:
    first = loader(sources, root, True, 2)
    list(take(first, 4))
    token = first.state_dict()
    reference = list(take(first, 12))
    resumed = loader(sources, root, True, 2)
    resumed.load_state_dict(token, skip_batches=3, reason="loss spike")
    assert all(batches_equal(a, b) for a, b in zip(take(resumed, 9), reference[3:], strict=True))
    resumed.state_dict()
    rolled = (
        connect(root)
        .execute("SELECT DISTINCT CAST(source AS VARCHAR) FROM lineage WHERE kind = 'rollback'")
        .fetchall()
    )
    assert sorted(r[0] for r in rolled) == ["code", "prose"]
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0, out.output


def noisy(record, ctx: SampleContext):
    """Tokens whose last one is drawn from the sample's seed: (source seed, source epoch,
    row), so a batch re-created with the wrong source epoch differs."""
    tokens = np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1
    return np.append(tokens, 300 + int(ctx.rng.integers(0, 1000)))


def noisy_text(record, ctx: SampleContext):
    return f"{record['text']}#{int(ctx.rng.integers(0, 10**6))}"


def noisy_mixture(sources, packing: bool) -> Mixture:
    code, prose = sources
    packer = Packer(seq_len=8) if packing else None
    transform = noisy if packing else noisy_text
    return Mixture(
        {
            "code": Stream(code, transform=transform, shuffle_buffer=3, packer=packer),
            "prose": Stream(prose, transform=transform, shuffle_buffer=4, packer=packer),
        },
        weights={"code": 0.6, "prose": 0.4},
    )


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_materialize_re_creates_every_batch_of_a_stream_mixture(
    sources, root, packing, workers
) -> None:
    from ledger.audit.queries import materialize
    from ledger.digest import batch_digest
    from ledger.stream.mixer import rebuild_mixed_batch

    collate = None if packing else list
    run = ledger.DataLoader(
        noisy_mixture(sources, packing), batch_size=3, shuffle=True, seed=5,
        num_workers=workers, log=root, collate_fn=collate,
    )  # fmt: skip
    received = list(take(run, 30))  # the small source goes through several of its epochs
    run.state_dict()
    con = connect(root)
    epochs = con.execute(
        "SELECT DISTINCT epoch, source_epoch FROM lineage WHERE kind IN ('sample', 'span')"
    ).fetchall()
    con.close()  # DuckDB's threads must not be running when the workers fork
    assert any(e != s for e, s in epochs) and all(s is not None for _, s in epochs)
    wrong = 0
    for b, got in enumerate(received):
        made = materialize(root, b, noisy_mixture(sources, packing), collate_fn=collate)
        assert made.matches and made.digest == batch_digest(got), b
        assert batches_equal(made.data, got), b
        # The recorded source epoch is what makes it exact: the mixture epoch instead
        # re-creates other batches.
        events = made.record.events
        guess = events.set_column(
            events.schema.get_field_index("source_epoch"),
            "source_epoch",
            pa.array(events["epoch"].to_numpy(), pa.int32()),
        )
        other = rebuild_mixed_batch(noisy_mixture(sources, packing), 5, guess, False, collate)
        wrong += not batches_equal(other, got)
    assert wrong > 0
    # verify_data re-creates the last committed batch on resume.
    resumed = ledger.DataLoader(
        noisy_mixture(sources, packing), batch_size=3, shuffle=True, seed=5,
        num_workers=workers, log=root, collate_fn=collate, verify_data=True,
    )  # fmt: skip
    resumed.load_state_dict(run.state_dict())
    assert batches_equal(next(iter(resumed)), next(iter(run)))


def test_a_log_without_source_epochs_cannot_re_create_a_stream_mixture_batch(sources) -> None:
    from ledger.errors import LedgerError
    from ledger.stream.mixer import rebuild_mixed_batch

    events = pa.table(
        {"source": ["code"], "sample_id": [3], "source_epoch": pa.nulls(1, pa.int32())}
    )
    with pytest.raises(LedgerError, match="does not record the source epoch"):
        rebuild_mixed_batch(noisy_mixture(sources, False), 5, events, False, list)


def test_the_journal_keeps_each_rows_source_epoch(tmp_path) -> None:
    from ledger.journal import Journal, read_journal
    from ledger.schema import SAMPLE, EventChunk, chunks_to_table

    chunk = EventChunk(
        SAMPLE, 1, 7, 0, 0, np.array([3, 4, 3], np.int64),
        positions=np.array([5, 7, 9], np.int64), sources=np.array([0, 1, 0], np.int16),
        source_names=("code", "prose"), source_epochs=np.array([4, 1, 5], np.int64),
    )  # fmt: skip
    journal = Journal(str(tmp_path / "j.msgpack"), 0, 0)
    journal.append(chunk)
    journal.close()
    _, (back,) = read_journal((tmp_path / "j.msgpack").read_bytes())
    assert back.source_epochs is not None and back.source_epochs.tolist() == [4, 1, 5]
    table = chunks_to_table([back], 0, 0)
    assert table["source_epoch"].to_pylist() == [4, 1, 5]
    assert table["epoch"].to_pylist() == [1, 1, 1]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_a_new_phase_changes_a_stream_mixtures_weights_exactly(
    sources, root, packing, workers
) -> None:
    from ledger.mixture import Phase

    old, new = {"code": 0.6, "prose": 0.4}, {"code": 0.1, "prose": 0.9}

    def make(weights) -> ledger.DataLoader:
        return ledger.DataLoader(
            mixture(sources, packing, weights), batch_size=3, shuffle=True, seed=5,
            num_workers=workers, log=root, collate_fn=None if packing else texts,
        )  # fmt: skip

    first = make(old)
    list(take(first, 5))
    token = first.state_dict()
    con = connect(root)
    reached = con.execute(
        f"SELECT max(epoch * {EPOCH} + position) FROM lineage WHERE kind IN ('sample', 'span')"
    ).fetchone()[0]
    con.close()  # DuckDB's threads must not be running when the workers fork
    # The phase, uninterrupted: 30 batches, committing now and then (tokens to resume).
    phased = make(new)
    phased.load_state_dict(token, new_phase=True)
    reference: list = []
    tokens = {}
    for stop in (2, 9, 17, 30):
        reference += list(take(phased, stop - len(reference)))
        tokens[stop] = phased.state_dict()
    # Resumed at each commit of the phase (no new_phase: the phase's own configuration),
    # the rest is the uninterrupted run's, element by element.
    for at, tok in tokens.items():
        if at == 30:
            continue
        resumed = make(new)
        resumed.load_state_dict(tok)
        rest = list(take(resumed, 30 - at))
        assert len(rest) == 30 - at
        assert all(batches_equal(a, b) for a, b in zip(rest, reference[at:], strict=True)), at
        resumed.state_dict()
    # The phase's start: past every position served before it; each position's source is
    # the old weights' below it and the new weights' from it on.
    from ledger.commits import list_commits, phase_of
    from ledger.store import Store

    store = Store(root)
    head = max(list_commits(store), key=lambda c: (c.attempt, c.step))
    phase = phase_of(store, head)
    assert phase is not None and phase["number"] == 1
    start = int(phase["start"])
    assert start > reached
    rows = (
        connect(root)
        .execute(
            f"""SELECT epoch * {EPOCH} + position, CAST(source AS VARCHAR) FROM lineage
        WHERE kind = 'sample' OR (kind = 'span' AND token_start = 0)"""
        )
        .fetchall()
    )
    positions = np.array([r[0] for r in rows], np.int64)
    assert len(set(positions.tolist())) == len(rows)  # each position once
    below, above = positions < start, positions >= start
    assert above.sum() > 20
    was = mixture(sources, packing, old)
    truth = np.empty(positions.size, np.int64)
    truth[below] = was.sources_at(5, positions[below])
    now = mixture(sources, packing, new)
    phase1 = Phase(start, np.array(phase["base"]), now.counts, now.schedule.starts, 1)
    truth[above] = phase1.locate(5, positions[above])[0]
    assert [r[1] for r in rows] == [now.names[s] for s in truth.tolist()]
    code_share = float(np.mean(truth[above] == 0))
    assert code_share < 0.3  # the new weights (0.1) rule from the start on
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0, out.output
    assert "in each of 2" in out.output, out.output  # per phase


def test_a_stream_mixtures_phases_chain_and_a_batch_size_phase_keeps_the_mixing(
    sources, root
) -> None:
    from ledger.commits import list_commits, phase_of
    from ledger.mixture import Phase
    from ledger.store import Store

    weights = [
        {"code": 0.6, "prose": 0.4},
        {"code": 0.1, "prose": 0.9},
        {"code": 0.9, "prose": 0.1},
    ]

    def make(w, batch_size: int = 3) -> ledger.DataLoader:
        return ledger.DataLoader(
            mixture(sources, False, w), batch_size=batch_size, shuffle=True, seed=5,
            num_workers=2, log=root, collate_fn=texts,
        )  # fmt: skip

    current = make(weights[0])
    list(take(current, 5))
    for w, size in ((weights[1], 3), (weights[2], 3), (weights[2], 4)):  # the last: size
        token = current.state_dict()
        current = make(w, size)
        current.load_state_dict(token, new_phase=True)
        list(take(current, 6))
    token = current.state_dict()
    reference = list(take(current, 12))
    resumed = make(weights[2], 4)
    resumed.load_state_dict(token)
    assert all(batches_equal(a, b) for a, b in zip(take(resumed, 12), reference, strict=True))
    resumed.state_dict()
    store = Store(root)
    head = max(list_commits(store), key=lambda c: (c.attempt, c.step))
    phase = phase_of(store, head)
    assert phase is not None and phase["number"] == 3
    # The batch size's phase keeps phase 2's mixing: the sources of two weight changes.
    assert phase["mix"]["number"] == 2 and len(phase["earlier"]) == 2
    starts = [0, phase["earlier"][1]["start"], phase["mix"]["start"]]
    assert starts[0] < starts[1] < starts[2]
    mixes = [mixture(sources, False, w) for w in weights]
    phases = [Phase(0, np.zeros(2, np.int64), mixes[0].counts, mixes[0].schedule.starts)]
    for i, rec in ((1, phase["earlier"][1]), (2, phase["mix"])):
        phases.append(
            Phase(rec["start"], np.array(rec["base"]), mixes[i].counts, mixes[i].schedule.starts, i)
        )
    con = connect(root)
    rows = con.execute(
        f"SELECT epoch * {EPOCH} + position, CAST(source AS VARCHAR) FROM lineage "
        "WHERE kind = 'sample'"
    ).fetchall()
    con.close()
    positions = np.array([r[0] for r in rows], np.int64)
    which = np.searchsorted(np.array(starts), positions, side="right") - 1
    truth = np.empty(positions.size, np.int64)
    for i, ph in enumerate(phases):
        sel = which == i
        truth[sel] = ph.locate(5, positions[sel])[0]
    assert [r[1] for r in rows] == [mixes[0].names[s] for s in truth.tolist()]
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0, out.output


BAD_CODE = {2, 7}  # rows of the code source whose transform raises


def flaky(record, ctx: SampleContext):
    if record["text"].startswith("code") and record["row"] in BAD_CODE:
        raise ValueError(f"bad row {record['row']}")
    ctx.record(flip=int(ctx.rng.integers(0, 2)))
    return np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1


def flaky_text(record, ctx: SampleContext):
    if record["text"].startswith("code") and record["row"] in BAD_CODE:
        raise ValueError(f"bad row {record['row']}")
    return record["text"]


def flaky_mixture(sources, packing: bool) -> Mixture:
    code, prose = sources
    packer = Packer(seq_len=8) if packing else None
    transform = flaky if packing else flaky_text
    return Mixture(
        {
            "code": Stream(code, transform=transform, shuffle_buffer=3, packer=packer),
            "prose": Stream(prose, transform=transform, shuffle_buffer=4, packer=packer),
        },
        weights={"code": 0.6, "prose": 0.4},
    )


def flaky_loader(sources, root, packing: bool, workers: int) -> ledger.DataLoader:
    return ledger.DataLoader(
        flaky_mixture(sources, packing), batch_size=3, shuffle=True, seed=5,
        num_workers=workers, log=root, collate_fn=None if packing else list, on_error="skip",
    )  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_mixture_leaves_out_bad_samples_exactly(sources, root, packing, workers) -> None:
    import json

    at = None if workers == 0 else [4, 11, 20]
    assert assert_resume_exact(
        lambda: flaky_loader(sources, root, packing, workers), batches=30, every=4, resume_at=at
    )
    # An uninterrupted run on its own root: bad rows never reach a batch; each is logged
    # as an error at its position, once per position, with its source and source epoch.
    own = os.path.join(root, "own")
    run = flaky_loader(sources, own, packing, workers)
    got = list(take(run, 30))
    run.state_dict()
    if packing:
        seen = {int(i) for b in got for i in b["sample_ids"].flatten().tolist() if i >= 0}
        assert not seen & BAD_CODE  # flat ids of code rows are the rows themselves
    else:
        texts_seen = [t for b in got for t in b]
        assert not [
            t for t in texts_seen if t.split()[0] == "code" and int(t.split()[1]) in BAD_CODE
        ]
    con = connect(own)
    errors = con.execute(
        "SELECT epoch, position, CAST(source AS VARCHAR), sample_id, source_epoch, value "
        "FROM lineage WHERE kind = 'error'"
    ).fetchall()
    firsts = con.execute(
        "SELECT epoch, position FROM lineage "
        "WHERE kind = 'sample' OR (kind = 'span' AND token_start = 0)"
    ).fetchall()
    con.close()
    assert errors and {(r[2], r[3]) for r in errors} == {("code", b) for b in BAD_CODE}
    assert all(r[4] is not None and json.loads(r[5])["type"] == "ValueError" for r in errors)
    served = firsts + [(r[0], r[1]) for r in errors]
    assert len(set(served)) == len(served)  # each position once, good or bad
    done = [p for e, p in served if e == 0]
    assert sorted(done) == list(range(EPOCH))  # mixture epoch 0 entirely accounted for
    out = CliRunner().invoke(main, ["audit", own, "--check", "coverage", "--check", "mixture"])
    assert out.exit_code == 0, out.output
    # Batches that left out a bad sample are re-created exactly (the bad one left out).
    from ledger.audit.queries import materialize

    con = connect(own)
    rows = con.execute("SELECT DISTINCT batch FROM lineage WHERE kind = 'error'").fetchall()
    con.close()
    with_errors = sorted(int(r[0]) for r in rows)
    assert with_errors
    for b in with_errors[:4]:
        made = materialize(
            own, b, flaky_mixture(sources, packing), collate_fn=None if packing else list
        )
        assert made.matches and batches_equal(made.data, got[b]), b


@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_mixture_with_bad_samples_resumes_elastically(sources, root, packing) -> None:
    token = None
    for workers, batches in ((2, 5), (1, 4), (3, 3)):
        current = flaky_loader(sources, root, packing, workers)
        if token is not None:
            current.load_state_dict(token)
        list(take(current, batches))
        token = current.state_dict()
    reference = list(take(current, 30))
    current.state_dict()
    again = flaky_loader(sources, root, packing, 3)
    again.load_state_dict(token)
    assert all(batches_equal(a, b) for a, b in zip(take(again, 30), reference, strict=True))
    again.state_dict()
    con = connect(root)
    served = con.execute(
        "SELECT epoch, position FROM lineage WHERE kind = 'error' OR kind = 'sample' "
        "OR (kind = 'span' AND token_start = 0)"
    ).fetchall()
    errors = con.execute("SELECT count(*) FROM lineage WHERE kind = 'error'").fetchone()[0]
    con.close()
    assert errors > 0 and len(set(served)) == len(served)
    last = max(e for e, _ in served)
    assert last >= 2
    for epoch in range(last):  # every finished mixture epoch: each position once
        assert sorted(p for e, p in served if e == epoch) == list(range(EPOCH)), epoch
    out = CliRunner().invoke(main, ["audit", root, "--check", "coverage", "--check", "mixture"])
    assert out.exit_code == 0, out.output


# ---------------------------------------------------------------------------------------
# A map-style source beside a stream: read through lanes over its seeded per-epoch order.


class Docs:
    """A map-style source of ``n`` documents whose text holds a draw from torch's global
    RNG (the lanes seed it per sample): token ids when ``packing``."""

    def __init__(self, n: int, packing: bool) -> None:
        self.n = n
        self.packing = packing

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        text = f"doc {i} {int(torch.randint(0, 1000, ()).item())}"
        if self.packing:
            return np.frombuffer(text.encode(), np.uint8).astype(np.int64) + 1
        return {"text": text}


def mixed(sources, packing: bool, docs: type | None = None) -> Mixture:
    _, prose = sources
    return Mixture(
        {
            "code": (docs or Docs)(sum(CODE_ROWS), packing),
            "prose": Stream(
                prose,
                transform=tokenize if packing else None,
                shuffle_buffer=4,
                packer=Packer(seq_len=8) if packing else None,
            ),
        },
        weights={"code": 0.6, "prose": 0.4},
    )


def mixed_loader(sources, root, packing: bool, workers: int) -> ledger.DataLoader:
    return ledger.DataLoader(
        mixed(sources, packing), batch_size=3, shuffle=True, seed=5, num_workers=workers,
        log=root, collate_fn=None if packing else texts,
    )  # fmt: skip


@pytest.mark.parametrize(("packing", "workers"), [(False, 0), (True, 0), (True, 2)])
def test_a_map_style_source_beside_a_stream_resumes_exactly(
    sources, root, packing, workers
) -> None:
    def make() -> ledger.DataLoader:
        return mixed_loader(sources, root, packing, workers)

    # 24 batches cross a mixture epoch (42 positions) and several of the map-style
    # source's epochs (12 samples, 60% of the positions).
    at = [2, 7, 16, 22] if workers == 0 else [5, 19]
    assert assert_resume_exact(make, batches=24, every=1, resume_at=at) == len(at)


def test_a_map_style_source_serves_its_seeded_order_of_each_of_its_epochs(sources, root) -> None:
    """One lane (no workers): the map-style source's samples are its EpochOrder of
    (source seed, source epoch), epoch after epoch, logged with their source epoch; every
    position is of the source the mixture's function gives; the audit passes."""
    from ledger.order import EpochOrder
    from ledger.stream.lanes import source_seed

    assert served(mixed_loader(sources, root, False, 0), 30)
    rows, last = _lineage(root)
    assert last >= 2
    _check_positions_and_sources(mixed(sources, False), 5, rows, last)
    con = connect(root)
    code = con.execute(
        "SELECT sample_id, source_epoch FROM lineage WHERE CAST(source AS VARCHAR) = 'code' "
        "ORDER BY batch, position"
    ).fetchall()
    con.close()
    n = sum(CODE_ROWS)
    key = source_seed(5, "code")
    epochs = len(code) // n + 1
    truth = np.concatenate([EpochOrder(n, key, e, True).range(0, n) for e in range(epochs)])
    assert [r[0] for r in code] == truth[: len(code)].tolist()
    assert [r[1] for r in code] == [i // n for i in range(len(code))]
    assert len(code) >= 3 * n  # the small source repeated
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0, out.output
    assert "shares within" in out.output


@pytest.mark.parametrize("packing", [False, True])
def test_a_map_style_source_beside_a_stream_resumes_elastically(sources, root, packing) -> None:
    """2 workers -> 1 mid-epoch: each old lane's rest of the map-style source's epoch is
    carried (with its own epoch's order) to the new lane; a resume inside the carried
    epoch is exact; every position once, of its source; the audit passes."""
    first = mixed_loader(sources, root, packing, 2)
    list(take(first, 5))
    token = first.state_dict()
    second = mixed_loader(sources, root, packing, 0)
    second.load_state_dict(token)
    list(take(second, 2))
    inside = second.state_dict()
    reference = list(take(second, 30))
    second.state_dict()
    again = mixed_loader(sources, root, packing, 0)
    again.load_state_dict(inside)
    assert all(batches_equal(a, b) for a, b in zip(take(again, 30), reference, strict=True))
    rows, last = _lineage(root)
    assert last >= 1  # mixture epoch 0, served by both shapes, is finished
    _check_positions_and_sources(mixed(sources, packing), 5, rows, last)
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture"])
    assert out.exit_code == 0, out.output


@pytest.mark.parametrize("packing", [False, True])
def test_materialize_re_creates_a_batch_with_a_map_style_source(sources, root, packing) -> None:
    """Every batch made by two workers is re-created from the log through the map-style
    source's ``dataset[i]`` with its per-sample seed (and the stream's transform)."""
    from ledger.audit.queries import materialize
    from ledger.digest import batch_digest

    collate = None if packing else texts
    run = mixed_loader(sources, root, packing, 2)
    received = list(take(run, 21 if packing else 20))  # the last with a code sample
    run.state_dict()
    for b, got in enumerate(received):
        made = materialize(root, b, mixed(sources, packing), collate_fn=collate)
        assert made.matches and made.digest == batch_digest(got), b
        assert batches_equal(made.data, got), b
    # verify_data re-creates the last committed batch on resume, and catches a map-style
    # source whose content changed under the same length.
    from ledger.errors import LedgerError

    token = run.state_dict()
    mixed_loader(sources, root, packing, 2).load_state_dict(token)  # (no verification)

    def verifying(mix: Mixture) -> ledger.DataLoader:
        return ledger.DataLoader(
            mix, batch_size=3, shuffle=True, seed=5, num_workers=2, log=root,
            collate_fn=collate, verify_data=True,
        )  # fmt: skip

    verifying(mixed(sources, packing)).load_state_dict(token)
    last = received[-1]
    if packing:  # flat ids: the code documents are 0 .. 11
        assert int(((last["sample_ids"] >= 0) & (last["sample_ids"] < 12)).sum()) > 0
    else:
        assert any(t.startswith("doc") for t in last)
    # Unpacked: the digest differs; packed: re-packing finds another token count first.
    expected = "data or the transform changed" if packing else "dataset content"
    with pytest.raises(LedgerError, match=expected):
        verifying(mixed(sources, packing, Shifted)).load_state_dict(token)


class FailingDraws(Draws):
    """Draws whose sample raises when its numpy draw is below 0.3 (a failure that depends
    on the seed: the lazily seeded lane must redo a sample that drew, then raised)."""

    def __getitem__(self, i: int) -> dict[str, object]:
        item = super().__getitem__(i)
        if float(item["draw"]) < 0.3:  # type: ignore[arg-type]
            raise ValueError(f"unlucky doc {i}")
        return item


@pytest.mark.parametrize(
    "which,drawing",
    [
        ("none", None),
        ("numpy", None),
        ("numpy-normal", "first"),  # one normal, in the training loop's cached one's place
        ("random-gauss", None),
        ("random", [3, 7]),  # only some samples draw
        ("numpy-fails", None),  # draws, then raises (on_error="skip")
    ],
)
def test_a_map_style_lane_seeds_numpy_and_random_lazily_with_the_eager_items(
    tmp_path, sources, monkeypatch, which, drawing
) -> None:
    """A map-style lane seeds numpy and random only once a sample drew from them
    (``ledger.fetch.seeded_lazily``); its items are those of seeding all three before
    every sample, item by item, over several of the source's epochs, whatever draws; the
    training loop's generators (cached normal variates included) are untouched; every
    batch is re-created from the log, lazily seeded again."""
    import random

    from ledger import fetch
    from ledger.audit.queries import materialize
    from ledger.order import EpochOrder
    from ledger.stream.lanes import source_seed

    n = sum(CODE_ROWS)
    if drawing == "first":  # only the lane's first sample draws
        drawing = [int(EpochOrder(n, source_seed(5, "code"), 0).range(0, 1)[0])]
    fails = which == "numpy-fails"

    def mix() -> Mixture:
        code = FailingDraws(n, "numpy") if fails else Draws(n, which, drawing)
        return Mixture(
            {"code": code, "prose": Stream(sources[1])}, weights={"code": 0.6, "prose": 0.4}
        )

    def run(at: str) -> tuple[ledger.DataLoader, list]:
        loader = ledger.DataLoader(
            mix(), batch_size=3, shuffle=True, seed=5, num_workers=0, log=str(tmp_path / at),
            collate_fn=list, on_error="skip" if fails else "raise",
        )  # fmt: skip
        return loader, list(take(loader, 20))  # 60 positions: code's epochs 0 .. 2

    monkeypatch.setattr(fetch, "_globals_drawn", True)  # seed all three every time
    _, eager = run("eager")
    monkeypatch.setattr(fetch, "_globals_drawn", False)
    loop_next = loop_generators_with_cached_variates()
    loader, lazy = run("lazy")
    assert (np.random.normal(), random.gauss(0, 1), float(torch.rand(()))) == loop_next
    assert fetch._globals_drawn == (which != "none")
    assert lazy == eager
    code = [item for batch in lazy for item in batch if "draw" in item]
    assert len(code) >= 2 * n - (n if fails else 0)
    if which != "none":
        assert len({item["draw"] for item in code}) > 1  # the draws are real
    if fails:
        assert sum(len(batch) for batch in lazy) < 60  # some samples failed
    loader.state_dict()
    for b, got in enumerate(lazy):
        monkeypatch.setattr(fetch, "_globals_drawn", False)
        made = materialize(str(tmp_path / "lazy"), b, mix(), collate_fn=list)
        assert made.matches and made.data == got, b


class Shifted(Docs):
    """Docs with other content under the same length."""

    def __getitem__(self, i: int):
        return super().__getitem__((i + 1) % self.n)


class FlakyDocs(Docs):
    """Docs whose items at :data:`BAD_CODE` raise."""

    def __getitem__(self, i: int):
        if i in BAD_CODE:
            raise ValueError(f"bad doc {i}")
        return super().__getitem__(i)


def test_a_map_style_source_beside_a_stream_leaves_out_bad_samples_exactly(sources, root) -> None:
    """on_error="skip": a map-style sample that raises keeps its position and is logged as
    an error with its source, index and source epoch; resume is exact; batches re-created."""
    import json

    from ledger.audit.queries import materialize

    def make(at: str) -> ledger.DataLoader:
        mix = Mixture(
            {"code": FlakyDocs(sum(CODE_ROWS), False), "prose": Stream(sources[1])},
            weights={"code": 0.6, "prose": 0.4},
        )
        return ledger.DataLoader(
            mix, batch_size=3, shuffle=True, seed=5, num_workers=2, log=at, collate_fn=texts,
            on_error="skip",
        )  # fmt: skip

    assert assert_resume_exact(lambda: make(root), batches=20, every=1, resume_at=[6, 15]) == 2
    own = os.path.join(root, "own")
    run = make(own)
    got = list(take(run, 20))
    run.state_dict()
    assert not [t for b in got for t in b if t.startswith("doc") and int(t.split()[1]) in BAD_CODE]
    con = connect(own)
    errors = con.execute(
        "SELECT batch, epoch, position, CAST(source AS VARCHAR), sample_id, source_epoch, value "
        "FROM lineage WHERE kind = 'error'"
    ).fetchall()
    firsts = con.execute("SELECT epoch, position FROM lineage WHERE kind = 'sample'").fetchall()
    con.close()
    assert errors and {(r[3], r[4]) for r in errors} == {("code", b) for b in BAD_CODE}
    assert all(r[5] is not None and json.loads(r[6])["type"] == "ValueError" for r in errors)
    placed = firsts + [(r[1], r[2]) for r in errors]
    assert len(set(placed)) == len(placed)
    assert sorted(p for e, p in placed if e == 0) == list(range(EPOCH))
    b = int(errors[0][0])
    mix = Mixture(
        {"code": FlakyDocs(sum(CODE_ROWS), False), "prose": Stream(sources[1])},
        weights={"code": 0.6, "prose": 0.4},
    )
    made = materialize(own, b, mix, collate_fn=texts)
    assert made.matches and batches_equal(made.data, got[b])


class BatchedDocs(Docs):
    """Docs with a batched ``__getitems__`` (as HF ``datasets``) that counts its calls."""

    def __init__(self, n: int, packing: bool) -> None:
        super().__init__(n, packing)
        self.calls: list[int] = []

    def __getitem__(self, i: int):
        return {"text": f"doc {i}"}

    def __getitems__(self, ids: list[int]) -> list:
        self.calls.append(len(ids))
        return [{"text": f"doc {i}"} for i in ids]


def test_a_batched_map_style_source_is_fetched_many_at_a_time_with_rng_off(sources, root) -> None:
    """rng="off": one __getitems__ call fetches the lane's next indices; the batches are
    those of dataset[i] one at a time (re-created so), and resume is exact."""
    docs = BatchedDocs(sum(CODE_ROWS), False)

    def make(dataset=docs, at: str = root) -> ledger.DataLoader:
        mix = Mixture(
            {"code": dataset, "prose": Stream(sources[1])}, weights={"code": 0.6, "prose": 0.4}
        )
        return ledger.DataLoader(
            mix, batch_size=3, shuffle=True, seed=5, log=at, collate_fn=texts, rng="off"
        )

    got = list(take(make(at=os.path.join(root, "first")), 20))
    code = sum(1 for b in got for t in b if t.startswith("doc"))
    assert docs.calls and len(docs.calls) < code  # many samples a call
    assert assert_resume_exact(make, batches=20, every=1, resume_at=[5, 14]) == 2

    class Plain:  # the same documents without __getitems__
        def __len__(self) -> int:
            return docs.n

        def __getitem__(self, i: int):
            return {"text": f"doc {i}"}

    plain = os.path.join(root, "plain")
    assert all(
        batches_equal(a, b) for a, b in zip(take(make(Plain(), plain), 20), got, strict=True)
    )


WEB_ROWS = (7, 5, 6)  # the source a new phase adds


def _changed(tmp_path, sources, packing: bool, weights: dict[str, float]) -> Mixture:
    """``code`` kept, ``prose`` removed, ``web`` added (the epoch size kept)."""
    code, _ = sources
    web = ShardedSource(str(tmp_path / "web" / "*.parquet"))
    packer = Packer(seq_len=8) if packing else None
    transform = tokenize if packing else None
    return Mixture(
        {
            "code": Stream(code, transform=transform, shuffle_buffer=3, packer=packer),
            "web": Stream(web, transform=transform, shuffle_buffer=2, packer=packer),
        },
        weights=weights,
        epoch_size=EPOCH,
    )


def _lanes(root: str, source: str) -> dict[int, list[tuple[int, int]]]:
    """Each logical worker's ``(source epoch, row)`` of ``source``, in the order served."""
    con = connect(root)
    rows = con.execute(
        f"""SELECT worker, source_epoch, sample_id FROM lineage
        WHERE kind = 'sample' AND CAST(source AS VARCHAR) = '{source}'
        ORDER BY epoch, position"""
    ).fetchall()
    con.close()
    out: dict[int, list[tuple[int, int]]] = {}
    for w, e, i in rows:
        out.setdefault(int(w), []).append((int(e), int(i)))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_new_phase_adds_and_removes_stream_sources(tmp_path, sources, workers) -> None:
    from ledger.commits import list_commits, phase_of
    from ledger.errors import ConfigMismatch
    from ledger.mixture import Phase
    from ledger.store import Store

    _write(tmp_path, "web", WEB_ROWS)
    new = {"code": 0.2, "web": 0.8}
    root = str(tmp_path / "log")

    def make(mix: Mixture, at: str = root, batch_size: int = 3) -> ledger.DataLoader:
        return ledger.DataLoader(
            mix, batch_size=batch_size, shuffle=True, seed=5, num_workers=workers, log=at,
            collate_fn=texts, verify_data=True,  # by name; a batch of prose: not re-created
        )  # fmt: skip

    first = make(mixture(sources, False))
    before = list(take(first, 5))
    boundary = first.state_dict()
    with pytest.raises(ConfigMismatch, match="mixture"):  # without new_phase: refused
        make(_changed(tmp_path, sources, False, new)).load_state_dict(boundary)

    def phased() -> ledger.DataLoader:
        current = make(_changed(tmp_path, sources, False, new), batch_size=4)
        current.load_state_dict(boundary, new_phase=True)
        return current

    # Exact resume at any batch of the phase (each resume without new_phase: the phase's
    # own configuration), and the phase itself the same at every start from the boundary.
    at = None if workers == 0 else [1, 4, 9]
    assert assert_resume_exact(phased, batches=10, every=1, resume_at=at) == (
        10 if at is None else 3
    )
    assert not any(t.startswith("web") for b in before for t in b)
    store = Store(root)
    head = max(list_commits(store), key=lambda c: (c.attempt, c.step))
    phase = phase_of(store, head)
    assert phase is not None and phase["number"] == 1
    assert phase["mix"]["names"] == ["code", "web"]
    assert phase["earlier"][0]["names"] == ["code", "prose"]
    start = int(phase["start"])
    # Lanes by name: code's lanes go on where they stood (the uninterrupted old run's
    # rows of code, per worker), web's start at its epoch 0, row 0 (a run of the new
    # mixture from the start serves the same rows of web, per worker).
    old_run, new_run = str(tmp_path / "old"), str(tmp_path / "new")
    served(make(mixture(sources, False), old_run), 20)
    served(make(_changed(tmp_path, sources, False, new), new_run), 20)
    for name, reference in (("code", old_run), ("web", new_run)):
        got, want = _lanes(root, name), _lanes(reference, name)
        assert sorted(got) == list(range(max(workers, 1))), name
        for w, ids in got.items():
            assert len(ids) > 3 and ids == want[w][: len(ids)], (name, w)
    # Every position once; below the start the old weights' sources (a position of the
    # removed prose left to a lagging worker: the new phase's, extended backward), from
    # it the new weights'.
    con = connect(root)
    rows = con.execute(
        f"SELECT epoch * {EPOCH} + position, CAST(source AS VARCHAR), batch FROM lineage "
        "WHERE kind = 'sample'"
    ).fetchall()
    con.close()
    positions = np.array([r[0] for r in rows], np.int64)
    assert len(set(positions.tolist())) == len(rows)
    assert set(range(start)) <= set(positions.tolist())
    # Below the start a position keeps its old source (the old weights'), except one of
    # the removed prose that a lagging worker serves after the boundary: its source is
    # the new phase's, extended backward from the start.
    was, now = mixture(sources, False), _changed(tmp_path, sources, False, new)
    phase1 = Phase(start, np.array(phase["base"]), now.counts, now.schedule.starts, 1)
    want = []
    replaced: list[str] = []
    for p, _, batch in rows:
        here = np.array([p], np.int64)
        if p >= start:
            want.append(now.names[int(phase1.locate(5, here)[0][0])])
        elif was.names[int(was.sources_at(5, here)[0])] == "code" or batch < len(before):
            want.append(was.names[int(was.sources_at(5, here)[0])])
        else:
            want.append(now.names[int(phase1.sources_before(5, here)[0])])
            replaced.append(want[-1])
    assert [r[1] for r in rows] == want
    # One logical worker never lags; with two, two positions of prose are left, both
    # taken by web, which the old phase never drew: the audit counts them in the new one.
    assert replaced == (["web", "web"] if workers else [])
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0, out.output
    assert "in each of 2" in out.output, out.output  # per phase
    out = CliRunner().invoke(main, ["audit", root])
    assert out.exit_code == 0 and "Shares per phase" in out.output, out.output


@pytest.mark.parametrize("cut_in", ["prose", "code"])
def test_a_new_phase_drops_the_rest_of_a_removed_sources_packed_sample(
    tmp_path, sources, cut_in
) -> None:
    _write(tmp_path, "web", WEB_ROWS)
    new = {"code": 0.3, "web": 0.7}
    root = str(tmp_path / "log")

    def make(mix: Mixture) -> ledger.DataLoader:
        return ledger.DataLoader(mix, batch_size=2, shuffle=True, seed=5, log=root)

    def last_span() -> tuple:
        con = connect(root)
        row = con.execute(
            f"""SELECT CAST(source AS VARCHAR), epoch * {EPOCH} + position, token_end, length,
            source_epoch FROM lineage WHERE kind = 'span' ORDER BY 2 DESC, token_end DESC LIMIT 1"""
        ).fetchone()
        con.close()
        return row

    # Stop where the packer is in the middle of a sample of the removed prose, or of the
    # kept code in its second epoch (its id is written anew for the new sources).
    first = make(mixture(sources, True))
    for _ in range(30):
        list(take(first, 1))
        boundary = first.state_dict()
        name, cut, end, length, source_epoch = last_span()
        if name == cut_in and end < length and (name == "prose" or source_epoch > 0):
            break
    assert name == cut_in and end < length

    def phased() -> ledger.DataLoader:
        current = make(_changed(tmp_path, sources, True, new))
        current.load_state_dict(boundary, new_phase=True)
        return current

    assert assert_resume_exact(phased, batches=10, every=1) == 10
    con = connect(root)
    rows = con.execute(
        f"""SELECT epoch * {EPOCH} + position, CAST(source AS VARCHAR), token_start, token_end,
        length FROM lineage WHERE kind = 'span' ORDER BY 1, 3"""
    ).fetchall()
    con.close()
    spans: dict[int, list[tuple]] = {}
    for p, name, a, b, n in rows:
        spans.setdefault(p, []).append((name, a, b, n))
    last = max(spans)
    short = [p for p, parts in spans.items() if parts[-1][2] < parts[-1][3] and p != last]
    # A prose sample in progress at the boundary ends there: its rest was dropped with its
    # source; every other sample (a code one begun before) is packed whole, once.
    assert short == ([cut] if cut_in == "prose" else [])
    for p, parts in spans.items():
        assert parts[0][1] == 0 and all(x[2] == y[1] for x, y in pairwise(parts)), p
    assert not any(parts[0][0] == "prose" for p, parts in spans.items() if p > cut)
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0, out.output


def test_a_change_of_shape_after_a_worker_finished_its_part_of_the_epoch(sources, root) -> None:
    """4 workers -> 1 when worker 0 has served all its positions of mixture epoch 0 and
    the others have not: the new worker serves only what no old worker served (the first
    position no old worker reached is the epoch's end, since worker 0 reached it)."""
    first = loader(sources, root, False, 4)
    list(take(first, 13))  # workers' 11/11/10/10 positions: worker 0's 4 batches, 3 each
    token = first.state_dict()
    again = loader(sources, root, False, 0)
    again.load_state_dict(token)
    list(take(again, 12))
    again.state_dict()
    rows, last = _lineage(root)
    assert last >= 1
    _check_positions_and_sources(mixture(sources, False), 5, rows, last)


def test_sources_change_only_once_an_earlier_change_of_shape_is_served(tmp_path, sources) -> None:
    """After 2 workers -> none, the lanes plan what the old shape left by place; a new phase
    with other sources is refused until every worker has gone past it, then it serves
    each position once, and resumes inside it are exact."""
    from ledger.errors import ConfigMismatch

    _write(tmp_path, "web", WEB_ROWS)
    root = str(tmp_path / "log")
    new = {"code": 0.5, "web": 0.5}
    first = loader(sources, root, False, 2)
    list(take(first, 5))
    token = first.state_dict()
    second = loader(sources, root, False, 0)
    second.load_state_dict(token)
    list(take(second, 2))
    inside = second.state_dict()  # still in the mixture epoch the old shape left

    def phased(at: dict) -> ledger.DataLoader:
        current = ledger.DataLoader(
            _changed(tmp_path, sources, False, new), batch_size=3, shuffle=True, seed=5,
            log=root, collate_fn=texts,
        )  # fmt: skip
        current.load_state_dict(at, new_phase=True)
        return current

    with pytest.raises(ConfigMismatch, match="still serves what the change of shape"):
        phased(inside)
    list(take(second, 24))  # past mixture epoch 0 and code's carried epoch
    later = second.state_dict()
    assert assert_resume_exact(lambda: phased(later), batches=8, every=1, resume_at=[2, 5]) == 2
    rows, _ = _lineage(root)
    positions = [r[0] * EPOCH + r[1] for r in rows]
    assert sorted(positions) == list(range(len(positions)))  # one logical worker: a prefix
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0, out.output


def test_source_phases_chain_with_a_weights_phase_between(tmp_path, sources) -> None:
    """code+prose -> code+web -> other weights -> web+prose (prose again from its epoch 0):
    each resume of the last phase is exact, each position served once, audits pass."""
    _write(tmp_path, "web", WEB_ROWS)
    root = str(tmp_path / "log")
    code, prose = sources
    web = ShardedSource(str(tmp_path / "web" / "*.parquet"))
    streams = {
        "code": Stream(code, shuffle_buffer=3),
        "prose": Stream(prose, shuffle_buffer=4),
        "web": Stream(web, shuffle_buffer=2),
    }

    def make(weights: dict[str, float]) -> ledger.DataLoader:
        mix = Mixture({n: streams[n] for n in weights}, weights=weights, epoch_size=EPOCH)
        return ledger.DataLoader(
            mix, batch_size=3, shuffle=True, seed=5, log=root, collate_fn=texts
        )

    current = make({"code": 0.6, "prose": 0.4})
    list(take(current, 4))
    for weights in ({"code": 0.5, "web": 0.5}, {"code": 0.2, "web": 0.8}):
        token = current.state_dict()
        current = make(weights)
        current.load_state_dict(token, new_phase=True)
        list(take(current, 4))
    last = current.state_dict()

    def final() -> ledger.DataLoader:
        resumed = make({"web": 0.5, "prose": 0.5})
        resumed.load_state_dict(last, new_phase=True)
        return resumed

    assert assert_resume_exact(final, batches=8, every=1, resume_at=[1, 4, 7]) == 3
    rows, _ = _lineage(root)
    positions = [r[0] * EPOCH + r[1] for r in rows]
    assert sorted(positions) == list(range(len(positions)))
    prose_rows = sorted(
        ((r[3], r[0] * EPOCH + r[1]) for r in rows if r[2] == "prose"), key=lambda x: x[1]
    )
    from ledger.commits import list_commits, phase_of
    from ledger.store import Store

    store = Store(root)
    phase = phase_of(store, max(list_commits(store), key=lambda c: (c.attempt, c.step)))
    assert phase is not None and phase["number"] == 3 and phase["mix"]["names"] == ["web", "prose"]
    assert [e["names"] for e in phase["earlier"]] == [
        ["code", "prose"], ["code", "web"], ["code", "web"]
    ]  # fmt: skip
    # prose again: its lane starts afresh, so its rows repeat those of phase 0 in order.
    again = [sid for sid, p in prose_rows if p >= phase["start"]]
    before = [sid for sid, p in prose_rows if p < phase["start"]]
    assert len(again) > 3 and again[: len(before)] == before[: len(again)]
    out = CliRunner().invoke(main, ["audit", root, "--check", "mixture", "--check", "coverage"])
    assert out.exit_code == 0 and "in each of 4" in out.output, out.output


def test_a_new_phase_is_not_taken_again_by_a_later_resume_of_the_loader(tmp_path, sources) -> None:
    """A loader that began a phase of new sources at a commit, and later resumes a token
    of another run on the same root (deleted and begun again with those sources: the
    same commit id, no phase), resumes that run as a fresh loader does: the first run's
    change of sources is not applied again."""
    import shutil

    _write(tmp_path, "web", WEB_ROWS)
    new = {"code": 0.2, "web": 0.8}
    root = str(tmp_path / "log")

    def make(mix: Mixture) -> ledger.DataLoader:
        return ledger.DataLoader(
            mix, batch_size=3, shuffle=True, seed=5, log=root, collate_fn=texts
        )

    first = make(mixture(sources, False))
    list(take(first, 5))
    boundary = first.state_dict()
    first.close()
    phased = make(_changed(tmp_path, sources, False, new))
    phased.load_state_dict(boundary, new_phase=True)
    list(take(phased, 2))
    shutil.rmtree(root)
    other = make(_changed(tmp_path, sources, False, new))  # the new sources from the start
    list(take(other, 5))
    token = other.state_dict()
    other.close()
    assert token["commit"] == boundary["commit"] and token["run_id"] != boundary["run_id"]
    fresh = make(_changed(tmp_path, sources, False, new))
    fresh.load_state_dict(token)
    want = list(take(fresh, 6))
    phased.load_state_dict(token)
    assert list(take(phased, 6)) == want
