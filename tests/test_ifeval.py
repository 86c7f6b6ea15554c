"""IFEval's verifiable instructions (utils/ifeval.py): every checker on answers written by hand that keep and break
it, IFEval's edge cases, a row's compliance share and its errors; the ``ifeval`` reward function as steps 2 and 3
call it, IFEval rows through the phase-3 data loader, the data builder (bench/ifeval_data.py) and the real-model
bench's guarded reward (bench/ifeval_reward.py, through the file.py:function hook)."""
import json

import pytest

from bench import ifeval_data as builder
from tests.conftest import REPO, shared_data
from utils.errors import UserInputError
from utils.ifeval import INSTRUCTIONS, check, compliance, count_sentences, count_words, describe, instructions_of
from utils.reward_functions import call_reward_fn, check_rows, ifeval, load_reward_fn

FIVE = "one two three four five"

# id: (kwargs, answers that keep it, answers that break it)
CASES = {
    "change_case:english_lowercase": ({}, ["all lower case, 2 numbers."], ["One capital."]),
    "change_case:english_capital": ({}, ["ALL CAPITALS, 2 NUMBERS."], ["ALMOST aLL"]),
    "change_case:capital_word_frequency": ({"capital_frequency": 2, "capital_relation": "at least"},
                                           ["SO VERY well", "a WELL-KNOWN FACT"], ["ONE only", "None At All"]),
    "length_constraints:number_words": ({"relation": "less than", "num_words": 5},
                                        ["one two three four", "one, two; three-four."], [FIVE, FIVE + " six"]),
    "length_constraints:number_sentences": ({"relation": "at least", "num_sentences": 2},
                                            ["One. Two!", "Is it? Yes."], ["Just one.", "Dr. Smith came home."]),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2},
                                             ["First.\n***\nSecond.", "***\nFirst.\n***\nSecond.\n***"],
                                             ["Only one.", "A.\n***\n\n***\nB."]),
    "length_constraints:nth_paragraph_first_word": ({"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
                                                    ["First one.\n\nThen, the second.", "A.\n\n\"Then\" B."],
                                                    ["First.\n\nNext.", "First.\n\nThen.\n\nThird."]),
    "punctuation:no_comma": ({}, ["No comma here."], ["One, two."]),
    "startend:end_checker": ({"end_phrase": "Any other questions?"},
                             ["Done. Any other questions?", "Done. any other questions?  \n",
                              '"Done. Any other questions?"'],
                             ["Any other questions? Bye.", "Done. Any other questions"]),
    "startend:quotation": ({}, ['"Wrapped."', '  "Wrapped."\n'], ['"Half wrapped.', '"'], ),
    "keywords:existence": ({"keywords": ["river", "Stone"]},
                           ["A stone by the RIVER.", "stones by the riverbank"], ["A stone alone."]),
    "keywords:frequency": ({"keyword": "tea", "frequency": 2, "relation": "less than"},
                           ["Tea time.", "Coffee."], ["Tea and TEA.", "tea, steep, team"]),
    "keywords:forbidden_words": ({"forbidden_words": ["bad", "Ugly"]},
                                 ["Badly made but badge-worthy.", "Fine."], ["It is BAD.", "so ugly!"]),
    "keywords:letter_frequency": ({"letter": "z", "let_frequency": 2, "let_relation": "at least"},
                                  ["Zig zag", "zz"], ["Zero", "none"]),
    "detectable_format:number_bullet_lists": ({"num_bullets": 2},
                                              ["* one\n* two", "Intro:\n- one\n  * two\n**Bold** line"],
                                              ["* one", "* one\n- two\n* three", "1. one\n2. two"]),
    "detectable_format:json_format": ({}, ['{"a": 1}', '```json\n{"a": [1, 2]}\n```', "```\n[1]\n```", "  42 "],
                                      ["{'a': 1}", '{"a": 1} and more', "```json\n{\n```"]),
    "detectable_format:title": ({}, ["<<A title>>\nText.", "Text <<poem of joy>> text."],
                                ["<< >> no title", "<<broken\ntitle>>", "No title."]),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 2},
                                                      ["*one* and *two*", "**bold** and *italic*"],
                                                      ["*one* only", "** ** and *one*"]),
    "detectable_format:multiple_sections": ({"section_spliter": "Section", "num_sections": 2},
                                            ["Section 1\nA.\nSection 2\nB."], ["Section 1\nA. Only one."]),
    "detectable_format:constrained_response": ({}, ["My answer is yes.", "Well. My answer is maybe."],
                                               ["Yes.", "My answer is yes"]),
    "detectable_content:postscript": ({"postscript_marker": "P.S."},
                                      ["Body.\n\nP.S. More.", "Body. p. s. more"], ["Body only.", "Body. PS more"]),
    "detectable_content:number_placeholders": ({"num_placeholders": 2}, ["[name] at [address]", "[a][b][c]"],
                                               ["[name] only", "no brackets"]),
    "combination:repeat_prompt": ({"prompt_to_repeat": "Describe the sea."},
                                  ["Describe the sea. It is wide.", "  describe THE sea. Blue."],
                                  ["Sure! Describe the sea. It is wide.", "Describe the sky."]),
    "combination:two_responses": ({}, ["Yes.\n******\nNo.", "******\nA\n******\nB\n******"],
                                  ["Same\n******\nSame", "A\n******\n\n******\nB", "Only one."]),
}


def test_every_instruction_has_a_case_and_at_least_twelve_kinds():
    assert set(CASES) == set(INSTRUCTIONS) and len(INSTRUCTIONS) >= 12


@pytest.mark.parametrize("instruction_id", sorted(CASES))
def test_each_checker_keeps_and_breaks(instruction_id):
    kwargs, keep, breaks = CASES[instruction_id]
    assert [check(instruction_id, kwargs, a) for a in keep] == [True] * len(keep)
    assert [check(instruction_id, kwargs, a) for a in breaks] == [False] * len(breaks)
    assert check(instruction_id, kwargs, "  \n") is False  # IFEval's strict rule: a blank answer keeps nothing
    assert describe(instruction_id, kwargs).strip()


def test_relations_at_their_boundaries():
    for n, relation, expected in [(4, "less than", True), (5, "less than", False), (5, "at least", True),
                                  (4, "at least", False)]:
        answer = " ".join(["word"] * n)
        assert check("length_constraints:number_words", {"relation": relation, "num_words": 5}, answer) is expected
        sentences = " ".join(["It is."] * n)
        assert check("length_constraints:number_sentences", {"relation": relation, "num_sentences": 5},
                     sentences) is expected
    assert check("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": "less than"},
                 "A banana") is False  # four a's, either case


def test_counting_words_and_sentences():
    assert count_words("It's well-known: 3.5 kg!") == 7  # it, s, well, known, 3, 5, kg: runs of \w
    assert count_sentences("") == 0 and count_sentences("no end mark") == 1
    assert count_sentences("Mr. Smith met Dr. Jones. They spoke, e.g. about J. K. Rowling! Fine?") == 3
    assert count_sentences("It costs 3.5 dollars. Wait... what?") == 3
    assert count_sentences("Steps:\n1. Mix it.\n2. Bake it.") == 2  # list numbers end nothing
    assert count_sentences("In 2020. Then more.") == 2
    assert count_sentences("* a\n* b") == 1  # like punkt, a line break alone ends nothing


def test_end_phrase_and_fences_follow_ifeval():
    end = {"end_phrase": "  Is there anything else I can help with?  "}  # IFEval strips the phrase
    assert check("startend:end_checker", end, "Text. Is there anything else I can help with?\n\n")
    assert not check("startend:end_checker", end, "Text. Is there anything else I can help with? Thanks")
    assert check("detectable_format:json_format", {}, "```JSON\n{\"k\": \"v\"}\n```\n")
    assert not check("detectable_format:json_format", {}, "Here it is: ```json\n{}\n```")


def test_prompt_texts_are_ifevals():
    assert describe("change_case:english_lowercase") == ("Your entire response should be in English, and in all "
                                                         "lowercase letters. No capital letters are allowed.")
    assert describe("length_constraints:number_words", {"relation": "less than", "num_words": 40}) == \
        "Answer with less than 40 words."
    assert describe("keywords:existence", {"keywords": ["sun", "sea"]}) == \
        'Include keywords "sun" and "sea" in the response.'
    assert describe("detectable_format:number_bullet_lists", {"num_bullets": 3}).startswith(
        "Your answer must contain exactly 3 bullet points. Use the markdown bullet points such as:\n* This is")


@pytest.mark.parametrize("instruction_id,kwargs,message", [
    ("nope:unknown", {}, "unknown IFEval instruction id 'nope:unknown'"),
    ("length_constraints:number_words", {"num_words": 5}, r"takes kwargs \['num_words', 'relation'\]; missing "
                                                          r"\['relation'\]"),
    ("punctuation:no_comma", {"num_words": 5}, r"takes kwargs \[\]; unexpected \['num_words'\]"),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at most"}, "'relation' must be one of"),
    ("length_constraints:number_words", {"num_words": "5", "relation": "at least"}, "'num_words' must be a whole"),
    ("keywords:existence", {"keywords": []}, "'keywords' must be a non-empty list of words"),
    ("keywords:letter_frequency", {"letter": "ab", "let_frequency": 1, "let_relation": "at least"}, "one letter"),
])
def test_bad_ids_and_kwargs_are_one_clear_error(instruction_id, kwargs, message):
    with pytest.raises(UserInputError, match=message):
        check(instruction_id, kwargs, "answer")


def test_none_kwargs_values_count_as_absent():
    # the hub copy (google/IFEval) fills every kwargs object with every name, null where unused
    hub = {"num_words": None, "relation": None, "keywords": None, "end_phrase": "Bye."}
    assert check("startend:end_checker", hub, "Well. Bye.") and check("punctuation:no_comma", None, "x")


def test_compliance_is_the_share_kept():
    one = {"prompt": "p", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [None]}
    assert compliance(one, "No commas.") == 1.0 and compliance(one, "A, b.") == 0.0
    two = {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
           "kwargs": [{}, {"relation": "less than", "num_words": 3}]}
    assert [compliance(two, a) for a in ["one two", "one, two", "one two three", "one, two, three"]] == \
        [1.0, 0.5, 0.5, 0.0]
    no_kwargs = {"instruction_id_list": ["startend:quotation", "detectable_format:title"]}  # kwargs missing: {} each
    assert compliance(no_kwargs, '"<<T>>"') == 1.0
    assert instructions_of(no_kwargs) == [("startend:quotation", {}), ("detectable_format:title", {})]


@pytest.mark.parametrize("row,message", [
    ({"key": 7, "prompt": "p"}, "row with key 7 has no instruction_id_list"),
    ({"prompt": "Say hi.", "instruction_id_list": []}, r"row \(prompt 'Say hi.'\) has no instruction_id_list"),
    ({"key": 1, "instruction_id_list": ["a:b"], "kwargs": [{}]}, "row with key 1: unknown IFEval instruction id 'a:b'"),
    ({"key": 2, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]}, "kwargs must be a list of 1"),
])
def test_a_bad_row_is_named(row, message):
    with pytest.raises(UserInputError, match=message):
        compliance(row, "answer")


# --------------------------------------------------------------------------- the reward function

ROWS = [{"key": 0, "prompt": "Say hi.", "instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}],
         "reference_answer": None},
        {"key": 1, "prompt": "Name two.", "instruction_id_list": ["detectable_format:number_bullet_lists",
                                                                   "punctuation:no_comma"],
         "kwargs": [{"num_bullets": 2}, None], "reference_answer": None}]


def test_ifeval_is_a_built_in_reward_function():
    fn = load_reward_fn("ifeval")
    assert fn is ifeval
    prompts = [" Human: Say hi. Assistant:", " Human: Name two. Assistant:"]
    assert call_reward_fn(fn, "ifeval", prompts, [" hi there", "* a, b\n* c"], ROWS) == [1.0, 0.5]
    # as collect_comparisons calls it: each prompt's row repeated for its K answers, flag --label_fn
    answers = [" hi", " Hi", "* a\n* b", "* a\n* b\n* c"]
    assert call_reward_fn(fn, "ifeval", [p for p in prompts for _ in range(2)], answers,
                          [r for r in ROWS for _ in range(2)], flag="--label_fn") == [1.0, 0.0, 1.0, 0.5]
    with pytest.raises(UserInputError, match=r"--reward_fn ifeval raised UserInputError: row with key 5 has no "
                                             r"instruction_id_list .* on row 1 \(prompt 'b'\)"):
        call_reward_fn(fn, "ifeval", ["a", "b"], ["x", "y"], [ROWS[0], {"key": 5, "prompt": "b"}])


def test_data_without_ifeval_instructions_is_refused_up_front_in_one_line():
    check_rows("ifeval", ["a", "b"], ROWS)
    rows = ROWS + [{"prompt": "x"}, {"prompt": "y", "instruction_id_list": ["language:response_language"]},
                   {"prompt": "z", "instruction_id_list": ["startend:end_checker"], "kwargs": [{}]}]
    with pytest.raises(UserInputError) as e:
        check_rows("ifeval", ["p"] * 5, rows, flag="--label_fn")
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        "--label_fn ifeval: 1 of 5 prompts have no instruction_id_list; 1 of 5 use unknown instruction ids "
        "(language:response_language); 1 of 5 have unusable kwargs (first: ")
    assert "missing ['end_phrase']" in message and "python bench/ifeval_data.py" in message


# --------------------------------------------------------------------------- through the data loaders

def _ifeval_rows(n):
    return [{"key": i, "prompt": f"Write about topic {i}.", "instruction_id_list": ["punctuation:no_comma",
                                                                                    "length_constraints:number_words"],
             "kwargs": [{}, {"relation": "less than", "num_words": 5 + i}]} for i in range(n)]


def test_prompt_only_and_builder_rows_get_a_layout():
    from utils.data.local_datasets import detect_layout

    assert detect_layout(["key", "prompt", "instruction_id_list", "kwargs"]) == "prompt_only"
    assert detect_layout(["key", "prompt", "instruction", "instruction_id_list", "kwargs", "reference_output"]) == \
        "prompt_only"  # the builder's rows: the prompt (with its constraints), not the bare instruction
    assert detect_layout(["instruction", "input", "output", "prompt"]) == "alpaca"  # as before
    assert detect_layout(["prompt", "rejected"]) == "prompt_chosen"  # still needs its chosen answer


def test_ifeval_rows_reach_the_reward_function_through_phase_3(tmp_path):
    from utils.data import data_utils as du
    from utils.model.model_utils import load_hf_tokenizer

    data = tmp_path / "ifeval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _ifeval_rows(30)))
    tok = load_hf_tokenizer("tiny-opt")
    train, _ = du.create_prompt_dataset(-1, [str(data)], "0,0,1", str(tmp_path / "cache"), 3, 1234, tok, 64)
    batch = du.DataCollatorRLHF(64, tok.pad_token_id)(train.samples[:4])
    for text, row in zip(batch["prompt_text"], batch["rows"]):
        assert text == row["prompt"] == f" Human: Write about topic {row['key']}. Assistant:"
        assert row["reference_answer"] is None
        assert row["kwargs"][1] == {"relation": "less than", "num_words": 5 + row["key"]}
    check_rows("ifeval", batch["prompt_text"], batch["rows"])
    assert call_reward_fn(ifeval, "ifeval", batch["prompt_text"], ["one two, three"] * 4, batch["rows"]) == [0.5] * 4
    # the comparison collector's loader gives the same rows
    prompts = du.phase_prompts([str(data)], "0,0,1", str(tmp_path / "split"), 3, 1234)["train"]
    assert len(prompts) == 27 and all(row["instruction_id_list"] == _ifeval_rows(1)[0]["instruction_id_list"]
                                      for _, row in prompts)
    with pytest.raises(UserInputError, match="no usable rows for phase 1"):  # no answers to imitate in them
        du.create_prompt_dataset(-1, [str(data)], "1,0,0", str(tmp_path / "cache1"), 1, 1234, tok, 64)


# --------------------------------------------------------------------------- the data builder

def _alpaca(n=40):
    rows = [{"instruction": f"Describe the colour number {i} in detail", "input": "",
             "output": f"Colour {i} glows warmly, shimmering against quiet evening skies."} for i in range(n)]
    rows += [{"instruction": "Translate this", "input": "bonjour", "output": "hello"},  # has an input: left out
             {"instruction": "Describe the colour number 3 in detail", "input": "", "output": "again"}]  # duplicate
    return rows


def _build(tmp_path, name, seed=7, heldout=10, rows=None):
    src = tmp_path / "alpaca.json"
    src.write_text(json.dumps(rows or _alpaca()))
    out = tmp_path / name
    assert builder.main(["--alpaca", str(src), "--out", str(out), "--seed", str(seed), "--heldout", str(heldout)]) == 0
    return {f: [json.loads(line) for line in (out / f).read_text().splitlines()] for f in builder.OUTPUTS}, out


def test_builder_is_deterministic_and_splits_by_instruction(tmp_path):
    files, out = _build(tmp_path, "a")
    again, out2 = _build(tmp_path, "b")
    assert all((out / f).read_bytes() == (out2 / f).read_bytes() for f in builder.OUTPUTS)
    train, held, plain, reworded = (files[f] for f in builder.OUTPUTS)
    assert len(train) == 30 and len(held) == len(plain) == len(reworded) == 10  # 40 distinct instructions, no input
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held}
    assert [(r["key"], r["instruction"], r["reference_output"]) for r in plain] == \
        [(r["key"], r["instruction"], r["reference_output"]) for r in held]
    assert all(r["prompt"] == r["instruction"] and "instruction_id_list" not in r for r in plain)
    assert {r["key"] for r in train + held} == set(range(40)) and "Translate this" not in str(train + held)
    other, _ = _build(tmp_path, "c", seed=8)
    assert {r["key"] for r in other["heldout.jsonl"]} != {r["key"] for r in held}  # the seed moves the split


def test_builder_rows_are_ifeval_rows_whose_kwargs_check(tmp_path):
    files, _ = _build(tmp_path, "a")
    for row in files["train.jsonl"] + files["heldout.jsonl"]:
        assert set(row) == {"key", "prompt", "instruction_id_list", "kwargs", "instruction", "reference_output"}
        assert len(row["kwargs"]) == len(row["instruction_id_list"]) in (1, 2)
        pairs = instructions_of(row)  # known ids, kwargs as the checkers take them
        assert row["prompt"] == " ".join([builder.with_period(row["instruction"])] + [describe(i, k) for i, k in pairs])
        assert all(isinstance(check(i, k, row["reference_output"]), bool) for i, k in pairs)
        assert 0.0 <= compliance(row, row["reference_output"]) <= 1.0


def test_drawn_constraints_never_contradict():
    seen, kinds = set(), set()
    for i in range(600):
        instruction = f"Explain topic {i} to a curious student"
        output = "Curious students learn quickly when examples connect ideas to everyday experiences."
        prompt, ids, kwargs = builder.constrain(instruction, output, seed=1234)
        kinds.update(ids)
        seen.add(len(ids))
        if len(ids) == 2:
            assert builder.compatible(*ids), ids
        for i_, k in zip(ids, kwargs):
            if i_ == "keywords:forbidden_words":  # never a word the rest of the prompt asks for
                rest = prompt.replace(describe(i_, k), "")
                assert check(i_, k, rest), (prompt, k)
        assert ids[-1] == "combination:repeat_prompt" or "combination:repeat_prompt" not in ids
    assert kinds == set(builder.DRAWS) and seen == {1, 2} and len(kinds) >= 12
    for a, b in [("change_case:english_lowercase", "change_case:english_capital"),
                 ("length_constraints:number_words", "detectable_format:number_bullet_lists"),
                 ("detectable_format:json_format", "detectable_format:title"),
                 ("startend:quotation", "detectable_format:title")]:
        assert not builder.compatible(a, b) and not builder.compatible(b, a)
    assert builder.compatible("keywords:existence", "keywords:forbidden_words")


def test_builder_refuses_bad_input_in_one_line(tmp_path, capsys):
    _, out = _build(tmp_path, "a")
    src = tmp_path / "alpaca.json"
    assert builder.main(["--alpaca", str(src), "--out", str(out)]) == 2  # earlier files, no --overwrite
    assert builder.main(["--alpaca", str(src), "--out", str(tmp_path / "n"), "--heldout", "40"]) == 2
    (tmp_path / "bad.json").write_text(json.dumps([{"instruction": "x", "output": 3}]))
    assert builder.main(["--alpaca", str(tmp_path / "bad.json"), "--out", str(tmp_path / "m")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [f"error: --out {out} already holds train.jsonl, heldout.jsonl, heldout_plain.jsonl, "
                      "heldout_reworded.jsonl; pass --overwrite to replace them, or give another --out",
                      "error: --alpaca: 40 distinct instructions with an empty input; --heldout 40 leaves none to "
                      "train on (give more rows or a smaller --heldout)",
                      f"error: --alpaca {tmp_path / 'bad.json'}: row 1: field 'output' must be a string, got int"]
    assert builder.main(["--alpaca", str(src), "--out", str(out), "--heldout", "10", "--overwrite"]) == 0


def test_builder_on_the_shared_alpaca_demo(tmp_path):
    src = shared_data("llama-factory-demo", "alpaca_en_demo.json")
    out = tmp_path / "ifeval"
    assert builder.main(["--alpaca", str(src), "--out", str(out), "--seed", "1234"]) == 0
    train, held = ([json.loads(x) for x in (out / f).read_text().splitlines()] for f in builder.OUTPUTS[:2])
    assert len(held) >= 200 and len(train) >= 300
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held}
    assert all(0.0 <= compliance(r, r["reference_output"]) <= 1.0 for r in train + held)


def test_the_reworded_set_left_the_bench_data_byte_for_byte_as_before(tmp_path):
    """heldout_reworded.jsonl came beside the other files without moving a byte of them: the bench's data (the
    shared alpaca demo, its seed, types and held-out count; uniform and with the recipe's --train_weights) hash as
    the builder wrote them before the set existed, so earlier runs' numbers stay comparable."""
    import hashlib

    src = shared_data("llama-factory-demo", "alpaca_en_demo.json")
    types = ("punctuation:no_comma,startend:end_checker,keywords:existence,keywords:forbidden_words,"
             "length_constraints:number_words,detectable_format:number_bullet_lists,detectable_content:postscript,"
             "detectable_format:title,detectable_format:number_highlighted_sections")  # bench_real_rl.TYPES
    before = {"heldout.jsonl": "cec270e3ff3259b719e562744794114977465b9403d4bb34f49bdd73920f670f",
              "heldout_plain.jsonl": "04b00f985304a58dd4df77e1bb15c3ebf17ee04987a71dac34818c530c6b2fc9"}
    trains = {None: "5739f621e1d695435c99256ce353a38c2484cc6a2cddb7ece020ce3cbe1656bc",
              "keywords:existence=2,keywords:forbidden_words=2,punctuation:no_comma=2,startend:end_checker=2":
              "bcf0b5f5caf7ea1c24acb43bf98763f11ae43d2de7b75ce2af0731c2a13fd3d8"}
    for n, (weights, train) in enumerate(trains.items()):
        out = tmp_path / str(n)
        assert builder.main(["--alpaca", str(src), "--out", str(out), "--seed", "1234", "--heldout", "220", "--types",
                             types, *(["--train_weights", weights] if weights else [])]) == 0
        digest = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in builder.OUTPUTS}
        assert digest == dict(before, **{"train.jsonl": train, "heldout_reworded.jsonl": digest[
            "heldout_reworded.jsonl"]})


# --------------------------------------------------------------------------- the content guard (ifeval_guarded)

GUARDED = f"{REPO / 'bench' / 'ifeval_reward.py'}:ifeval_guarded"  # as --reward_fn takes it


def test_the_guard_pays_nothing_for_an_answer_that_is_only_the_constraint():
    from bench.ifeval_reward import guarded_compliance, other_words, substance
    from utils.reward_functions import call_reward_fn, load_reward_fn

    end = {"instruction_id_list": ["startend:end_checker"], "kwargs": [{"end_phrase": "That is all."}]}
    assert compliance(end, "That is all.") == 1.0 and other_words(end, "That is all.") == 0
    assert guarded_compliance(end, "That is all.") == 0.0  # gamed: compliance 1, nothing answered
    answer = "Crepes need flour, eggs and milk; whisk them, rest the batter and fry thin rounds. That is all."
    assert other_words(end, answer) == 15 and guarded_compliance(end, answer) == 1.0
    assert substance(end, "Whisk flour and eggs. That is all.") == pytest.approx(0.4)  # 4 of 10 words
    keyword = {"instruction_id_list": ["keywords:existence"], "kwargs": [{"keywords": ["crema"]}]}
    assert guarded_compliance(keyword, "crema") == 0.0 and compliance(keyword, "crema") == 1.0
    # under "less than N words" the guard asks for half the limit at most
    short = {"instruction_id_list": ["length_constraints:number_words"],
             "kwargs": [{"relation": "less than", "num_words": 8}]}
    assert substance(short, "Mix, rest, fry thin.") == 1.0 and guarded_compliance(short, "Mix, rest, fry thin.") == 1.0
    fn = load_reward_fn(GUARDED)
    assert call_reward_fn(fn, "ifeval_guarded", ["p", "p"], ["That is all.", answer], [end, end]) == [0.0, 1.0]


def test_the_guard_pays_a_repeated_answer_its_share_of_distinct_trigrams():
    from bench.ifeval_reward import guarded_compliance, variety

    assert variety("a b c a b c") == pytest.approx(3 / 4)  # abc, bca, cab, abc: 3 distinct of 4
    assert variety("Whisk the eggs, then fry.") == 1.0 and variety("too short") == 1.0 and variety("") == 1.0
    assert variety("P.S. P.S. P.S. P.S.") == pytest.approx(2 / 6)  # p s p, s p s: 2 distinct of 6
    ps = {"instruction_id_list": ["detectable_content:postscript"], "kwargs": [{"postscript_marker": "P.S."}]}
    fresh = "Flour, eggs and milk make the batter; rest it an hour and fry thin rounds in butter. P.S. Enjoy them warm."
    looped = fresh + " P.S. Enjoy them warm. P.S. Enjoy them warm. P.S. Enjoy them warm."
    assert compliance(ps, looped) == compliance(ps, fresh) == 1.0 and guarded_compliance(ps, fresh) == 1.0
    assert guarded_compliance(ps, looped) == pytest.approx(variety(looped)) and variety(looped) < 0.8


def test_the_kept_label_is_the_constraints_kept_past_both_guards_and_nothing_else():
    """The comparisons' label (``ifeval_kept``): compliance where an answer answers (substance 1) and does not
    repeat itself (variety ≥ 0.9), else 0; no content term, so answers keeping the same constraints tie."""
    from bench.ifeval_reward import kept

    two = {"instruction_id_list": ["punctuation:no_comma", "detectable_content:postscript"],
           "kwargs": [{}, {"postscript_marker": "P.S."}], "reference_output": "Whisk flour and eggs."}
    both = "Whisk flour and eggs then rest the batter an hour and fry thin rounds in butter. P.S. Serve warm."
    one = both.replace(" P.S. Serve warm.", "")  # no comma, no postscript: ½
    assert kept(two, both) == 1.0 and kept(two, one) == 0.5
    assert kept(two, one.replace("eggs", "eggs,")) == 0.0  # a comma: neither constraint kept
    assert kept(two, "Fry them. P.S. Warm.") == 0.0  # both kept, 3 words besides the marker: not an answer
    looped = both + " P.S. Serve warm. P.S. Serve warm."  # 20 of 26 trigrams distinct: 0.77 < 0.9
    assert compliance(two, looped) == 1.0 and kept(two, looped) == 0.0
    fn = load_reward_fn(f"{REPO / 'bench' / 'ifeval_reward.py'}:ifeval_kept")
    assert call_reward_fn(fn, "ifeval_kept", ["p"] * 3, [both, one, looped], [two] * 3) == [1.0, 0.5, 0.0]


def test_the_content_term_pays_nothing_for_a_forbidden_word():
    """The builder draws forbidden words from alpaca's answer, the very text the content term compares with: a
    term that counted them paid for breaking the instruction (a little: +0.009 on average for writing them into
    alpaca's own answer; docs/real-model.md). They are taken out of the reference."""
    from bench.ifeval_reward import CONTENT_WEIGHT, forbidden_words, guarded_compliance, unigram_f1

    assert unigram_f1("mix flour and eggs", "Mix flour and eggs.") == 1.0
    # reference {mix, and, eggs}; answer {mix, flour, and, eggs}: overlap 3, precision 3/4, recall 1
    assert unigram_f1("mix flour and eggs", "Mix flour and eggs.", leave_out=["Flour"]) == pytest.approx(6 / 7)
    assert unigram_f1("flour", "flour", leave_out=["flour"]) == 0.0
    row = {"instruction_id_list": ["keywords:forbidden_words", "detectable_content:postscript"],
           "kwargs": [{"forbidden_words": ["flour", "butter"]}, {"postscript_marker": "P.S."}],
           "reference_output": "Whisk flour, eggs and milk, then fry in butter."}
    assert forbidden_words(row) == ["flour", "butter"] and forbidden_words({"instruction_id_list": ["punctuation"
                                                                                                 ":no_comma"]}) == []
    breaks = "Whisk flour, eggs and milk, then fry in butter."  # the reference itself: both words, no P.S.
    # compliance 0 (forbidden words used, no postscript): only the content term, which no longer counts them:
    # reference {whisk, eggs, and, milk, then, fry, in} (7) against the answer's 9 words: F1 = 2·7/(9+7)
    assert guarded_compliance(row, breaks) == pytest.approx(CONTENT_WEIGHT * 14 / 16)
    assert guarded_compliance(row, breaks) < CONTENT_WEIGHT * unigram_f1(breaks, row["reference_output"])


def test_the_builder_draws_only_the_types_asked_for(tmp_path):
    rows = [{"instruction": f"Describe the colour number {i} of the rainbow in detail.", "input": "",
             "output": "It is a warm and bright colour seen after rain."} for i in range(30)]
    types = ("punctuation:no_comma", "change_case:english_lowercase")
    files = builder.build(rows, seed=3, heldout=10, types=types)
    used = {i for part in ("train.jsonl", "heldout.jsonl") for r in files[part] for i in r["instruction_id_list"]}
    assert used == set(types)
    source = tmp_path / "alpaca.json"
    source.write_text(json.dumps(rows))
    assert builder.main(["--alpaca", str(source), "--out", str(tmp_path / "out"), "--types", "no:such_type"]) == 2


def test_train_weights_change_the_training_draws_only(tmp_path, capsys):
    """``--train_weights``: the named types drawn W times as often in train.jsonl; heldout.jsonl byte for byte as
    without it, so runs trained on weighted data are scored on the same prompts."""
    rows = [{"instruction": f"Describe the colour number {i} of the rainbow in detail.", "input": "",
             "output": "It is a warm and bright colour seen after rain."} for i in range(400)]
    types = ("punctuation:no_comma", "detectable_content:postscript", "detectable_format:title")
    plain = builder.build(rows, seed=3, heldout=100, types=types)
    weighted = builder.build(rows, seed=3, heldout=100, types=types,
                             train_weights={"punctuation:no_comma": 4.0})
    assert weighted["heldout.jsonl"] == plain["heldout.jsonl"]
    assert weighted["heldout_plain.jsonl"] == plain["heldout_plain.jsonl"]
    assert weighted["heldout_reworded.jsonl"] == plain["heldout_reworded.jsonl"]

    def first_share(part):  # the first constraint's odds: 4 of 6 weighted, 1 of 3 uniform
        return sum(r["instruction_id_list"][0] == "punctuation:no_comma" for r in part) / len(part)

    assert first_share(plain["train.jsonl"]) == pytest.approx(1 / 3, abs=0.08)
    assert first_share(weighted["train.jsonl"]) == pytest.approx(4 / 6, abs=0.08)
    source = tmp_path / "alpaca.json"
    source.write_text(json.dumps(rows))
    out = tmp_path / "out"
    assert builder.main(["--alpaca", str(source), "--out", str(out), "--seed", "3", "--heldout", "100", "--types",
                         ",".join(types), "--train_weights", "punctuation:no_comma=4"]) == 0
    assert [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()] == weighted["train.jsonl"]
    capsys.readouterr()
    for bad in ("punctuation:no_comma=0", "punctuation:no_comma", "startend:end_checker=2", "=3"):
        assert builder.main(["--alpaca", str(source), "--out", str(tmp_path / bad), "--types", ",".join(types),
                             "--train_weights", bad]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors[0] == "error: --train_weights: 'punctuation:no_comma=0' is not TYPE=W with a positive number W"
    assert errors[1] == "error: --train_weights: 'punctuation:no_comma' is not TYPE=W with a positive number W"
    assert errors[2].startswith("error: --train_weights: startend:end_checker is not among the types drawn")
    assert len(errors) == 4
