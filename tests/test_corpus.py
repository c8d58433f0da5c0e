"""The user's corpus (zeropp_jax/train/corpus.py), the tokenizers and `zeropp-tokenize`,
and every bad data flag: one line, status 2, before anything compiles."""

import json
import pathlib

import numpy as np
import pytest

from zeropp_jax.train import corpus, data, tokenize_corpus
from zeropp_jax.train.flags import parse_args
from zeropp_jax.train.tokenizer import load_tokenizer

SMALL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--seq-len", "16"]
SMALL += ["--batch", "8", "--eval-batches", "1", "--no-progress"]


def test_tokens_read_windows_across_pieces_without_reading_a_file_whole(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 300
    corpus.write_token_file(str(tmp_path / "a.bin"), ids[:600])
    corpus.write_token_file(str(tmp_path / "b.bin"), ids[600:])
    pieces = [corpus.read_token_file(str(tmp_path / n)) for n in ("a.bin", "b.bin")]
    assert all(isinstance(p, np.memmap) for p in pieces)
    tokens = corpus.Tokens(pieces)
    assert len(tokens) == 1000 and tokens.max_id() == 299
    starts = np.array([0, 590, 595, 983])  # two windows cross the files' boundary
    np.testing.assert_array_equal(
        tokens.windows(starts, 17), ids[starts[:, None] + np.arange(17)].astype(np.int32)
    )
    head, tail = tokens.split_tail(5)
    assert (len(head), len(tail)) == (950, 50)
    np.testing.assert_array_equal(tail.slice(0, 50), ids[950:])


def test_a_process_reads_only_its_rows_of_the_same_global_batch():
    tokens = corpus.Tokens([np.arange(5000, dtype=np.uint16)])
    kw = dict(seed=3, step=7, batch_size=8, seq_len=16)
    whole = data.sample_batch(tokens, **kw)
    np.testing.assert_array_equal(data.sample_batch(tokens, **kw, rows=slice(4, 8)), whole[4:])
    # The same windows as an in-memory array gives: the data order is the corpus's, not
    # its storage's.
    np.testing.assert_array_equal(data.sample_batch(np.arange(5000, dtype=np.int32), **kw), whole)


def test_split_by_file_hash_else_the_last_tokens(tmp_path):
    (tmp_path / "many").mkdir()
    for i in range(60):
        (tmp_path / "many" / f"f{i:02d}.txt").write_text(f"file {i}\n" * 5)
    (tmp_path / "many" / "image.png").write_bytes(b"\x89PNG\0\0\0")  # skipped as binary
    (tmp_path / "many" / ".hidden").write_text("skipped")
    got = corpus.load_corpus(
        [str(tmp_path / "many")], None, load_tokenizer("bytes"), vocab_size=256
    )
    assert len(got.train_files) + len(got.val_files) == 60 and got.val_files
    assert all(data.is_validation(f) for f in got.val_files)
    assert "1 binary skipped" in got.description and got.unit == "byte"
    one = tmp_path / "one.txt"
    one.write_bytes(bytes(range(32, 127)) * 20)
    got = corpus.load_corpus([str(one)], None, load_tokenizer("bytes"), vocab_size=256)
    assert (len(got.train), len(got.val)) == (1805, 95) and "last 5%" in got.description
    np.testing.assert_array_equal(
        got.val.slice(0, 95), np.frombuffer(one.read_bytes()[-95:], np.uint8)
    )


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A BPE of 300 ids learned offline from 1 MB of the standard library's source, and
    its token files (zeropp-tokenize, in-process)."""
    out = tmp_path_factory.mktemp("bpe")
    argv = ["--max-corpus-mb", "1", "--vocab-size", "300", "--out", str(out)]
    assert tokenize_corpus.main(argv) == 0
    return out


def test_bpe_learned_offline_on_the_standard_library_round_trips(bpe):
    tok = load_tokenizer(str(bpe / "tokenizer.json"))
    assert tok.vocab_size == 300
    stdlib = data.load_corpus(max_bytes=2**20)  # the same files and split as zeropp-train's
    for split, text in (("train", stdlib.train), ("val", stdlib.val)):
        ids = corpus.read_token_file(str(bpe / f"{split}.bin"))
        assert ids.max() < 300
        assert tok.decode(ids).encode() == text.astype(np.uint8).tobytes()  # to the byte
        assert len(ids) < 0.7 * len(text)  # merges learned: fewer tokens than bytes
    meta = json.loads((bpe / "meta.json").read_text())
    assert meta["val_files"] == list(stdlib.val_files)


def test_the_vocabulary_follows_the_tokenizer(bpe, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n" * 200)
    args = parse_args([*SMALL, "--data", str(text), "--tokenizer", str(bpe / "tokenizer.json")])
    assert args.vocab_size == 384  # 300 ids, rounded up to a multiple of 128
    got = corpus.from_flags(args)
    assert got.unit == "token" and got.train.max_id() < 300 and got.bytes_per_token > 1.2
    assert parse_args([*SMALL, "--data", str(text)]).vocab_size == 256
    assert parse_args(["--model", "125m", "--data", str(text)]).vocab_size == 256
    assert parse_args(["--model", "125m"]).vocab_size == 50304  # the built-in corpus
    bins = [str(bpe / "train.bin"), "--val-data", str(bpe / "val.bin")]
    args = parse_args([*SMALL, "--data", *bins, "--tokenizer", str(bpe / "tokenizer.json")])
    got = corpus.from_flags(args)
    assert got.unit == "token" and 1.3 < got.bytes_per_token < 2.0
    assert isinstance(got.train.pieces[0], np.memmap)


def _bad_inputs(tmp: pathlib.Path) -> list[tuple[list[str], str]]:
    (tmp / "empty").mkdir()
    (tmp / "empty" / "a.txt").write_text("")
    corpus.write_token_file(str(tmp / "ids.bin"), np.array([1, 2, 300, 4] * 50))
    (tmp / "bad.json").write_text('{"not": "a tokenizer"}')
    (tmp / "short.txt").write_text("0123456789" * 2)
    return [
        (["--data", str(tmp / "missing.txt")], "missing.txt: no such file or directory"),
        (["--data", str(tmp / "none*.txt")], "the pattern matches no file"),
        (["--data", str(tmp / "empty")], "the training split holds no tokens"),
        (["--data", str(tmp / "ids.bin"), "--vocab-size", "256"], "token id 300 in the"),
        (["--data", str(tmp / "ids.bin")], "give --vocab-size N or the --tokenizer"),
        (["--data", str(tmp / "short.txt"), "--tokenizer", str(tmp / "bad.json")], "not a Hug"),
        (["--tokenizer", str(tmp / "nope.json")], "nope.json: no such file"),
        (["--data", str(tmp / "short.txt")], "--seq-len 16: the validation split holds 1 byte,"),
        (["--val-data", str(tmp / "short.txt")], "--val-data needs --data"),
        (["--train-tokenizer", "300"], "learns from --data text"),
        (["--data", str(tmp / "short.txt"), "--train-tokenizer", "300", "--tokenizer",
          str(tmp / "bad.json")], "drop --tokenizer"),
        (["--data", str(tmp / "ids.bin"), "--train-tokenizer", "300"], "already a token file"),
        (["--data", str(tmp / "short.txt"), "--train-tokenizer", "256"], "pick a size in 257"),
        (["--data", str(tmp / "empty"), "--train-tokenizer", "300"], "holds no tokens"),
    ]  # fmt: skip


def test_bad_data_gives_one_line_and_exit_2_before_compiling(tmp_path, capsys, monkeypatch):
    import jax

    from zeropp_jax.train import cli

    def no_compile(*a, **k):
        raise AssertionError("compiled before reporting bad data")

    monkeypatch.setattr(jax, "jit", no_compile)
    for flags, message in _bad_inputs(tmp_path):
        with pytest.raises(SystemExit) as exc:
            cli.main([*SMALL, "--out", str(tmp_path / "run"), *flags])
        err = capsys.readouterr().err
        assert exc.value.code == 2, (flags, err)
        assert err.count("\n") == 1 and err.startswith("zeropp-train: error: "), err
        assert message in err, (message, err)


def test_train_tokenizer_learns_a_bpe_into_the_run_and_trains_on_it(tmp_path, monkeypatch):
    """`zeropp-train --train-tokenizer N`: the BPE is learned from the --data text, saved as
    OUT/tokenizer.json, and the corpus is encoded with it (stopped there, before compiling)."""
    from zeropp_jax.train import cli

    text = tmp_path / "text"
    text.mkdir()
    for path in sorted(pathlib.Path(tokenize_corpus.__file__).parent.glob("*.py"))[:6]:
        (text / path.name).write_bytes(path.read_bytes())
    loaded = {}

    class Loaded(Exception):
        pass

    def stop_after_loading(args):
        loaded["args"], loaded["corpus"] = args, real(args)
        raise Loaded

    real = corpus.from_flags
    monkeypatch.setattr(corpus, "from_flags", stop_after_loading)
    out = tmp_path / "run"
    with pytest.raises(Loaded):
        cli.main([*SMALL, "--data", str(text), "--train-tokenizer", "300", "--out", str(out)])
    args, got = loaded["args"], loaded["corpus"]
    assert args.tokenizer == str(out / "tokenizer.json") and args.vocab_size == 384
    tok = load_tokenizer(args.tokenizer)
    assert tok.vocab_size == 300 and got.unit == "token" and 1.2 < got.bytes_per_token < 3
    sample = (text / sorted(p.name for p in text.iterdir())[0]).read_bytes()[:2000]
    assert tok.decode(tok.encode(sample)).encode() == sample


def test_tokenize_and_sample_bad_input_gives_one_line_and_exit_2(tmp_path, capsys):
    from zeropp_jax.train import sample

    (tmp_path / "t.bin").write_bytes(b"\0\0")
    (tmp_path / "norun").mkdir()
    cases = [
        (tokenize_corpus.main, ["--vocab-size", "100", "--out", "x"], "pick a size in 257"),
        (tokenize_corpus.main, ["--data", str(tmp_path / "t.bin"), "--vocab-size", "300",
                                "--out", str(tmp_path)], "already a token file"),
        (sample.main, ["--out", str(tmp_path / "norun")], "no run.json there"),
        (sample.main, ["--out", "x", "--tokens", "0"], "--tokens and --num-samples"),
    ]  # fmt: skip
    for main, argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err
