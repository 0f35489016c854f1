"""Task suite: determinism, disjoint splits, worked solutions that check out, scoring, the tokenizer."""
import random
import re

from pathlib import Path

import pytest

from dllm_core.tasks import LONG_TASKS, TASKS, Arithmetic, Count, Progression, Retrieval, Sort, final_answer, make_task, \
    parse_tasks, split_of
from dllm_core.tasks.base import TEST_FRACTION

MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_examples_are_deterministic_and_distinct(name):
    task = make_task(name)
    a, b = task.examples("test", 20, seed=3), task.examples("test", 20, seed=3)
    assert a == b
    assert len({e.key for e in a}) == 20
    assert task.examples("test", 20, seed=4) != a


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_test_never_overlap(name):
    task = make_task(name)
    test = task.examples("test", 200)
    rng = random.Random(0)
    train = [task.sample(rng, "train") for _ in range(2000)]
    assert all(split_of(e.key) == "test" for e in test)
    assert all(split_of(e.key) == "train" for e in train)
    assert not {e.key for e in test} & {e.key for e in train}
    assert not {e.prompt for e in test} & {e.prompt for e in train}


def test_split_fraction_is_about_ten_percent():
    keys = [str(i) for i in range(20000)]
    frac = sum(split_of(k) == "test" for k in keys) / len(keys)
    assert abs(frac - TEST_FRACTION) < 0.01
    assert split_of("12+3-4") == split_of("12+3-4")  # stable (sha256, not Python's salted hash)


def test_arithmetic_worked_solution_is_correct():
    for ex in Arithmetic().examples("train", 300, seed=1):
        m = re.fullmatch(r"(\d+)((?:[+-]\d+=\d+)+)\n#### (\d+)", ex.response)
        assert m, ex.response
        steps = re.findall(r"([+-])(\d+)=(\d+)", m.group(2))
        assert 2 <= len(steps) <= 3
        nums = [int(n) for n in re.findall(r"\d+", ex.prompt)]
        assert nums == [int(m.group(1))] + [int(n) for _, n, _ in steps]  # numbers come from the prompt, in order
        total = int(m.group(1))
        for op, n, r in steps:  # each step continues from the previous total
            total = total + int(n) if op == "+" else total - int(n)
            assert int(r) == total and 0 <= total <= 99
        assert m.group(3) == ex.answer == str(total)
        assert Arithmetic().score(ex.response, ex)


def test_arithmetic_forms_and_defaults():
    chain = Arithmetic(hi=40, max_operand=15, max_total=99).examples("test", 50)
    restated = Arithmetic(hi=40, max_operand=15, max_total=99, form="restated").examples("test", 50)
    assert [(e.prompt, e.answer, e.key) for e in chain] == [(e.prompt, e.answer, e.key) for e in restated]
    e = next(e for e in restated if e.key == "19-15-3")
    assert e.response == "19-15=4. 4-3=1.\n#### 1"
    assert next(c for c in chain if c.key == "19-15-3").response == "19-15=4-3=1\n#### 1"
    assert all(len(x) == 1 for ex in Arithmetic().examples("test", 200) for x in re.findall(r"\d+", ex.prompt))
    with pytest.raises(ValueError, match=r"--tasks arithmetic.form must be one of \['chain', 'restated'\]"):
        make_task("arithmetic:form=prose")


def test_arithmetic_scoring_uses_final_answer():
    ex = Arithmetic().examples("test", 1)[0]
    t = Arithmetic()
    assert t.score(f"whatever\n#### {ex.answer}", ex)
    assert not t.score(f"#### {ex.answer}1", ex)
    assert not t.score(ex.answer, ex)  # no '####' -> no answer
    assert final_answer("1+2=3.\n#### 3 #### 4") == "4"


def test_sort_and_retrieval_and_count_answers():
    for ex in Sort().examples("test", 50):
        xs = [int(v) for v in ex.prompt.split(":")[1].split()]
        assert ex.answer == " ".join(map(str, sorted(xs))) and 4 <= len(xs) <= 10
        assert Sort().score("  " + ex.answer.replace(" ", "  ") + " ", ex)
        assert not Sort().score(ex.answer[::-1] + " 0", ex)
    for ex in Retrieval().examples("test", 20):
        q = ex.prompt.splitlines()[-1].rstrip(":")
        lines = dict(line.split(": ") for line in ex.prompt.splitlines()[1:-2])
        assert len(lines) == 100 and lines[q] == ex.answer
    ex = Count().examples("test", 1)[0]
    a, b = map(int, re.findall(r"\d+", ex.prompt))
    assert ex.answer.split() == [str(i) for i in range(a + 1, b + 1)] and b - a == 500
    assert Count.prefix_match(ex.answer, ex.answer) == 1.0
    assert Count.prefix_match(" ".join(ex.answer.split()[:250]) + " 7", ex.answer) == 0.5


def test_progression_worked_solution_is_correct():
    for ex in Progression(min_days=1, days=40).examples("train", 300, seed=1):
        start, step, days = (int(n) for n in re.findall(r"\d+", ex.prompt))
        head, *lines, last = ex.response.split("\n")
        assert 1 <= days <= 40 and len(lines) == days and last == f"#### {start + days * step}"
        assert head == f"Day 0: {start} +{step}"  # the givens, restated next to the work
        for i, line in enumerate(lines, 1):  # each day adds the same step to the day before
            assert line == f"Day {i}: {start + i * step}"
        assert ex.answer == str(start + days * step) < "999" and Progression().score(ex.response, ex)
        assert not Progression().score(ex.response.replace(f"#### {ex.answer}", "#### 0"), ex)
    with pytest.raises(ValueError, match="totals must stay below 1000"):
        make_task("progression:days=60")


@pytest.mark.parametrize("canvas", sorted(LONG_TASKS))
def test_long_tasks_fill_their_canvas(canvas):
    """The long-answer settings: every answer fits its canvas (blocks of 32) and takes most of it."""
    from dllm_core.tokenizer import load_tokenizer
    from dllm_core.train.data import stream_keys

    tok = load_tokenizer(MODELS / "llada-tasks")
    for task in parse_tasks(LONG_TASKS[canvas]):
        assert (task.gen_length, task.block_length) == (canvas, 32)
        lens = [len(tok(e.response)["input_ids"]) + 1 for e in task.examples("test", 100)]  # + EOT
        assert 0.75 * canvas < max(lens) <= canvas, (task.label, max(lens))
    mix = parse_tasks("count:span=48;count:min_span=40,span=100;sort")
    assert stream_keys(mix) == ["count", "count:span=100,min_span=40", "sort"]


def test_task_specs_and_errors():
    assert parse_tasks("arithmetic; retrieval:pairs=40,min_pairs=4") == [Arithmetic(), Retrieval(40, 4)]
    with pytest.raises(ValueError, match=r"--tasks: unknown policy 'algebra'; allowed: \['arithmetic', 'count'"):
        make_task("algebra")
    with pytest.raises(ValueError, match="--tasks: sort has no option 'size'"):
        make_task("sort:size=3")
    with pytest.raises(ValueError, match="min_pairs <= pairs"):
        make_task("retrieval:pairs=10,min_pairs=20")
    with pytest.raises(ValueError, match="split must be one of"):
        Sort().examples("valid", 3)


def test_tokenizer_digits_specials_and_lengths(tmp_path):
    from dllm_core.tasks.evaluate import prompts_of, special_ids
    from dllm_core.tokenizer import load_tokenizer
    from dllm_core.train.data import encode
    from dllm_core.train.tokenizer import build_task_tokenizer

    build_task_tokenizer(tmp_path)
    shipped = MODELS / "llada-tasks" / "tokenizer.json"
    if shipped.is_file():  # the vocabulary every shipped task model was trained with (task wording changes pinned)
        assert (tmp_path / "tokenizer.json").read_bytes() == shipped.read_bytes()
    tok = load_tokenizer(tmp_path)
    ids = special_ids(tok)
    assert len(set(ids.values())) == 4 and tok.pad_token == "<|endoftext|>" and tok.mask_token == "<|mdm_mask|>"
    assert tok.convert_ids_to_tokens(tok("x 1234", add_special_tokens=False)["input_ids"])[-4:] == list("1234")
    ex = Arithmetic().examples("test", 1)[0]
    p, r = encode(tok, ex, ids["eot"])
    assert p[0] == ids["bos"] and r[-1] == ids["eot"] and tok.decode(r[:-1]) == ex.response
    for t in (Arithmetic(), Sort()):  # responses + EOT fit the canvas the models use
        assert max(len(encode(tok, e, ids["eot"])[1]) for e in t.examples("test", 200)) <= t.gen_length
    assert min(map(len, prompts_of(tok, Retrieval().examples("test", 10)))) >= 1000
    for ex in Retrieval().examples("test", 20):  # the asked key has the tokens of its entry
        ids = tok(ex.prompt, add_special_tokens=False)["input_ids"]
        q = tok("\n" + ex.prompt.splitlines()[-1], add_special_tokens=False)["input_ids"]
        assert ids[-len(q):] == q and any(ids[i:i + len(q)] == q for i in range(len(ids) - len(q)))


def test_few_shot_prompts():
    """The papers' few-shot prompts: ``shots`` worked examples from the train split, fixed per question, in one user
    turn or as user/assistant turns; the question and its split unchanged."""
    from dllm_core.tasks.evaluate import prompts_of
    from dllm_core.tokenizer import load_tokenizer

    plain, one = Count(span=48), make_task("count:span=48,shots=3")
    turns = make_task("count:span=48,shots=3,shot_format=turns")
    assert (one.shots, turns.shot_format, one.label) == (3, "turns", "count:shots=3,span=48")
    for p, a, b in zip(plain.examples("test", 5), one.examples("test", 5), turns.examples("test", 5)):
        assert a.key == b.key == p.key and a.answer == p.answer and b.prompt == p.prompt
        worked = a.prompt.split("\n\n")
        assert len(worked) == 4 and worked[-1] == p.prompt and len(b.turns) == 3
        for text, (user, assistant) in zip(worked, b.turns):
            assert text == f"{user}\n{assistant}" and split_of(user.split()[3]) == "train"
            assert plain.extract(assistant) == assistant  # a whole worked answer
    assert one.examples("test", 5) == one.examples("test", 5)
    tok = load_tokenizer(MODELS / "llada-long")
    ex = turns.examples("test", 1)[0]
    ids = prompts_of(tok, [ex])[0]
    text = tok.decode(ids)
    assert text.count("<|start_header_id|>user") == 4 and text.count("<|start_header_id|>assistant") == 4
    assert 700 < len(prompts_of(tok, one.examples("test", 1))[0]) < 900  # GSM8K 5-shot: about 740
    from dllm_core.train.data import ChatEncoder, encode

    batch = [ex, one.examples("test", 1)[0], plain.examples("test", 1)[0]]  # training batches mix the formats
    assert ChatEncoder(tok, 7)(batch) == [encode(tok, e, 7) for e in batch] and encode(tok, ex, 7)[0] == ids
    with pytest.raises(ValueError, match=r"count.shot_format must be one of \['one_turn', 'turns'\], got 'chat'"):
        make_task("count:shots=2,shot_format=chat")
    with pytest.raises(ValueError, match="count.shots must be an integer >= 0, got -1"):
        make_task("count:shots=-1")
