import json
import re

import pytest

from lrmq.data import synthetic
from lrmq.data.pipeline import PromptPipeline
from lrmq.data.prompts import PROMPT_TEMPLATES, _extract_last_boxed, format_prompt, load_prompt_dataset
from lrmq.data.synthetic import ArithDifficulty, generate_split, make_splits, solve


# ----------------------------------------------------------------------------- synthetic


def test_solve_precedence():
    steps, v = solve([12, 7, 3, 5], ["+", "*", "-"])
    assert steps == ["7*3=21", "12+21=33", "33-5=28"] and v == 28
    assert solve([2, 3, 4], ["*", "*"]) == (["2*3=6", "6*4=24"], 24)
    assert solve([5, 9], ["-"]) == (["5-9=-4"], -4)


def test_synthetic_rows_are_correct_and_small_alphabet():
    rows = generate_split(300, seed=1, difficulty=ArithDifficulty(min_ops=1, max_ops=3, max_operand=20))
    alphabet = set("0123456789+-*=. ") | set("Compute") | set("\\boxed{}")
    for r in rows:
        m = re.fullmatch(r"Compute ([0-9+\-*]+)\.", r["problem"])
        assert m, r
        expr = m.group(1)
        assert 1 <= sum(expr.count(o) for o in "+-*") <= 3
        assert int(r["answer"]) == eval(expr)  # python precedence == ours
        assert r["solution"].endswith(f"\\boxed{{{r['answer']}}}")
        for step in r["solution"].split(". ")[:-1]:
            lhs, rhs = step.rstrip(".").split("=")
            assert eval(lhs) == int(rhs) >= 0, step  # allow_negative=False: no negative intermediate
        assert set(r["problem"] + r["solution"]) <= alphabet
    assert len({r["problem"] for r in rows}) == 300
    assert {sum(r["problem"].count(o) for o in "+-*") for r in rows} == {1, 2, 3}


def test_synthetic_seeded_and_splits_disjoint(tmp_path):
    assert generate_split(50, 7) == generate_split(50, 7)
    assert generate_split(50, 7) != generate_split(50, 8)
    # one op, operands <= 12: 169 sums + 91 non-negative differences + 100 products = 360 problems
    train, test = make_splits(260, 100, seed=3, difficulty=ArithDifficulty(max_ops=1, max_operand=12))
    assert len(train) == 260 and len(test) == 100
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    one_op = generate_split(20, 0, ArithDifficulty(min_ops=1, max_ops=1, max_operand=3))
    assert all(len(r["solution"].split(". ")) == 2 for r in one_op)
    with pytest.raises(ValueError, match="distinct problems"):  # the space has < 50 problems
        generate_split(50, 0, ArithDifficulty(max_ops=1, max_operand=2, max_mul_operand=2))
    with pytest.raises(ValueError, match="min_ops"):
        ArithDifficulty(min_ops=2, max_ops=4)
    p = tmp_path / "d" / "train.jsonl"
    synthetic.write_jsonl(p, train)
    assert synthetic.read_jsonl(p) == train
    assert [f.name for f in p.parent.iterdir()] == ["train.jsonl"]


def test_synthetic_cli(tmp_path):
    synthetic.main(["--out", str(tmp_path), "--n-train", "30", "--n-eval", "10", "--seed", "2"])
    ds = load_prompt_dataset(tmp_path / "train.jsonl", cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 30 and ds.column_names == ["problem", "answer"]


# ----------------------------------------------------------------------------- prompt datasets

ROWS = [
    {"problem": "What is $1+1$?", "solution": "We get \\boxed{2}.", "answer": "2", "level": 1},
    {"problem": "Simplify $\\frac{4}{8}$.", "solution": "\\boxed{x} wrong, so \\boxed{\\frac{1}{2}}", "answer": "\\frac{1}{2}", "level": 3},
    {"problem": "Find 3*3.", "solution": "It is \\boxed 9", "answer": "9", "level": 2},
]


def test_extract_last_boxed():
    assert _extract_last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert _extract_last_boxed("\\boxed{{a}{b}}") == "{a}{b}"
    assert _extract_last_boxed("\\boxed 9 then") == "9"
    assert _extract_last_boxed("\\boxed{3} then \\boxed{unbalanced") == "3"
    assert _extract_last_boxed("\\fbox{7}") == "7"
    assert _extract_last_boxed("no box") is None


@pytest.fixture
def files(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    out = {}
    out["jsonl"] = tmp_path / "d.jsonl"
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out["json"] = tmp_path / "d.json"
    out["json"].write_text(json.dumps(ROWS))
    out["parquet"] = tmp_path / "d.parquet"
    ds.to_parquet(str(out["parquet"]))
    out["csv"] = tmp_path / "d.csv"
    ds.to_csv(str(out["csv"]), index=False)
    out["disk"] = tmp_path / "saved"
    ds.save_to_disk(str(out["disk"]))
    out["dict"] = tmp_path / "saved_dict"
    datasets.DatasetDict({"test": ds}).save_to_disk(str(out["dict"]))
    out["cache"] = str(tmp_path / "cache")
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "disk"])
def test_load_formats(files, fmt):
    ds = load_prompt_dataset(files[fmt], cache_dir=files["cache"])
    assert ds.column_names == ["problem", "answer"]
    assert ds["problem"] == [r["problem"] for r in ROWS]
    assert ds["answer"] == [r["answer"] for r in ROWS]


def test_answer_from_solution_and_renamed_fields(tmp_path, files):
    rows = [{"question": r["problem"], "sol": r["solution"]} for r in ROWS]
    p = tmp_path / "q.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_prompt_dataset(p, problem_field="question", answer_field="gt", solution_field="sol", cache_dir=files["cache"])
    assert ds["answer"] == ["2", "\\frac{1}{2}", "9"]
    # numeric answers become strings; multiple paths concatenate; DatasetDict dirs pick the split
    q = tmp_path / "num.jsonl"
    q.write_text(json.dumps({"problem": "p", "answer": 5}) + "\n")
    both = load_prompt_dataset([files["jsonl"], q], cache_dir=files["cache"])
    assert both["answer"] == ["2", "\\frac{1}{2}", "9", "5"]
    assert len(load_prompt_dataset(files["dict"], split="test")) == 3


def test_load_errors(tmp_path, files):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_dataset(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.parquet"
    import datasets

    datasets.Dataset.from_dict({"problem": [], "answer": []}).to_parquet(str(empty))
    with pytest.raises(ValueError, match="empty.parquet is empty"):
        load_prompt_dataset(empty, cache_dir=files["cache"])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        load_prompt_dataset(tmp_path / "empty.jsonl", cache_dir=files["cache"])
    with pytest.raises(KeyError, match=r"d.jsonl: missing problem field 'question'; available columns: \['problem', 'solution', 'answer', 'level'\]"):
        load_prompt_dataset(files["jsonl"], problem_field="question", cache_dir=files["cache"])
    with pytest.raises(KeyError, match=r"missing answer field 'gt'.*available columns"):
        load_prompt_dataset(files["jsonl"], answer_field="gt", solution_field="nosol", cache_dir=files["cache"])
    nobox = tmp_path / "nobox.jsonl"
    nobox.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    with pytest.raises(ValueError, match=r"nobox.jsonl: 1 row\(s\) have no answer .* first at row 0"):
        load_prompt_dataset(nobox, cache_dir=files["cache"])
    with pytest.raises(KeyError, match=r"no split 'train'; available: \['test'\]"):
        load_prompt_dataset(files["dict"])
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        (tmp_path / "x.txt").write_text("x")
        load_prompt_dataset(tmp_path / "x.txt")


def test_templates():
    assert PROMPT_TEMPLATES.names() == ["arith", "chat", "qwen_math", "raw"]
    p = "Let $f(x)={x}^2$. Find f(3)."
    assert format_prompt("raw", p) == p
    assert format_prompt("qwen_math", p) == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\nLet $f(x)={x}^2$. Find f(3).<|im_end|>\n<|im_start|>assistant\n"
    )
    assert format_prompt("arith", "Compute 1+2.") == "Compute 1+2. Answer:"
    with pytest.raises(ValueError, match="needs a tokenizer"):
        format_prompt("chat", p)
    with pytest.raises(KeyError, match="unknown prompt template 'nope'"):
        format_prompt("nope", p)


def test_chat_template_uses_tokenizer():
    import tokenizers

    from lrmq.tokenizer import Tokenizer

    tok = Tokenizer(
        tokenizers.Tokenizer(tokenizers.models.WordLevel({"<eos>": 0, "[UNK]": 1}, unk_token="[UNK]")),
        special_tokens={"eos_token": "<eos>"},
        chat_template="{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}",
    )
    assert format_prompt("chat", "Compute 1+2.", tok) == (
        "[user]Compute 1+2.\nPlease reason step by step, and put your final answer within \\boxed{}.<eos>[assistant]"
    )


# ----------------------------------------------------------------------------- pipeline

RECORDS = [{"problem": f"p{i}", "answer": str(i)} for i in range(23)]


def take(pipe, k):
    return [next(pipe) for _ in range(k)]


def test_pipeline_batches_and_restore():
    a = PromptPipeline(RECORDS, batch_size=4, seed=0, process_index=0, process_count=1)
    first = take(a, 3)
    assert all(set(b) == {"problem", "answer"} and len(b["problem"]) == 4 for b in first)
    assert all(b["answer"] == [p[1:] for p in b["problem"]] for b in first)
    state = json.loads(json.dumps(a.get_state()))  # JSON round trip, as in a checkpoint
    expected = take(a, 10)  # crosses the epoch boundary (23 records, 5 batches/epoch)
    b = PromptPipeline(RECORDS, batch_size=4, seed=0, process_index=0, process_count=1)
    b.set_state(state)
    assert take(b, 10) == expected
    assert a.steps_per_epoch == 5


def test_pipeline_seed_order_and_epochs():
    def order(seed, shuffle=True):
        p = PromptPipeline(RECORDS, batch_size=2, seed=seed, shuffle=shuffle, num_epochs=1,
                           process_index=0, process_count=1)
        return [x for b in p for x in b["problem"]]

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert sorted(order(0)) != order(0) and len(order(0)) == 22 and len(set(order(0))) == 22
    assert order(0, shuffle=False) == [f"p{i}" for i in range(22)]
    # repeating reshuffles each epoch, and each epoch is a permutation
    p = PromptPipeline(RECORDS[:8], batch_size=4, seed=0, process_index=0, process_count=1)
    e1, e2 = [sum((b["problem"] for b in take(p, 2)), []) for _ in range(2)]
    assert sorted(e1) == sorted(e2) == sorted(r["problem"] for r in RECORDS[:8]) and e1 != e2


def test_pipeline_sharding_disjoint():
    shards = []
    for pi in range(3):
        p = PromptPipeline(RECORDS, batch_size=2, seed=5, num_epochs=1, process_index=pi, process_count=3)
        shards.append([x for b in p for x in b["problem"]])
    assert [len(s) for s in shards] == [6, 6, 6]  # 23 // 3 = 7 per process, 3 batches of 2
    flat = sum(shards, [])
    assert len(set(flat)) == len(flat)


def test_pipeline_hf_dataset_and_errors():
    import datasets

    ds = datasets.Dataset.from_list(RECORDS)
    p = PromptPipeline(ds, batch_size=3, seed=1, process_index=0, process_count=1)
    q = PromptPipeline(RECORDS, batch_size=3, seed=1, process_index=0, process_count=1)
    assert take(p, 4) == take(q, 4)
    with pytest.raises(ValueError, match="state is from a different pipeline .*seed: saved 1 vs now 2"):
        PromptPipeline(RECORDS, batch_size=3, seed=2, process_index=0, process_count=1).set_state(p.get_state())
    with pytest.raises(ValueError, match="fewer than batch_size=9"):
        PromptPipeline(RECORDS, batch_size=9, seed=0, process_index=0, process_count=3)
    with pytest.raises(ValueError, match="records is empty"):
        PromptPipeline([], batch_size=1, seed=0, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="process_index 3 not in"):
        PromptPipeline(RECORDS, batch_size=1, seed=0, process_index=3, process_count=3)
