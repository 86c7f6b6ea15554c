"""Reward functions (utils/reward_functions.py): the built-in ones by hand, loading a user's file, and every way a
function can fail, each one clear line naming the function and the row."""
import pytest

from utils.errors import UserInputError
from utils.reward_functions import (builtin_rule, call_reward_fn, check_rows, gsm8k, last_number, load_reward_fn)

LAMP = " Human: Describe the lamp. Assistant:"


def test_builtin_rule_is_the_held_out_checks_score():
    answers = [" The lamp is bright and kind and calm.", " The lamp is bright and bright and calm.",
               " The river is dull and kind and calm."]
    # all four checks; a repeat fails no_repeat (3/4); another object and a bad word fail two (2/4)
    assert builtin_rule([LAMP] * 3, answers, [{}] * 3) == [1.0, 0.75, 0.5]
    with pytest.raises(ValueError, match="not a built-in prompt"):
        builtin_rule([" Human: hi Assistant:"], ["x"], [{}])


def test_gsm8k_compares_the_last_numbers():
    rows = [{"reference_answer": "3 + 4 = 7\n#### 7"}] * 3 + [{"reference_answer": "#### 1,200"}]
    answers = ["It is 7.", "3 + 4 = 8", "The answer is 7.0 apples", "so 1200"]
    assert gsm8k([""] * 4, answers, rows) == [1.0, 0.0, 1.0, 1.0]
    assert last_number("from -3 to 2,500.5 then") == 2500.5 and last_number("none") is None
    with pytest.raises(ValueError, match="no reference answer"):
        gsm8k([""], ["7"], [{"reference_answer": "7"}])


@pytest.mark.parametrize("text, number", [
    ("The loss is −72 dollars.", -72.0),  # the Unicode minus
    ("She lost -$72.", -72.0),  # a minus before the currency sign
    ("She lost $-72.", -72.0),
    ("so the change is –4", -4.0),  # an en dash written as a minus
    ("It is 7,2", 2.0),  # a comma separates thousands only in groups of three: 7 and 2, not 72
    ("1,234,567 grains", 1234567.0),
    ("between 60-72 minutes", 72.0),  # a range: 60 to 72, not 60 and -72
    ("COVID-19 cases", 19.0),  # a dash inside a name is no minus
    ("(3)-5", 5.0),
    ("x = (-5)", -5.0),
    ("answer: - 72", -72.0),
    ("$1,200.50 in total", 1200.5),
    ("is 7.", 7.0),
    ("no number here", None),
])
def test_gsm8k_reads_numbers_as_a_grader_does(text, number):
    assert last_number(text) == number


def test_gsm8k_scores_negative_and_grouped_answers():
    rows = [{"reference_answer": "... = -72\n#### -72"}] * 4 + [{"reference_answer": "#### 72"}] * 2
    answers = ["The result is −72.", "A loss of -$72", "between 60-72", "It is 72", "7,2", "72"]
    assert gsm8k([""] * 6, answers, rows) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_data_without_what_a_function_needs_is_refused_up_front():
    with pytest.raises(UserInputError, match=r"--reward_fn gsm8k: 1 of 2 prompts have no reference answer"):
        check_rows("gsm8k", ["a", "b"], [{"reference_answer": "#### 3"}, {"reference_answer": None}])
    with pytest.raises(UserInputError, match="--reward_fn builtin_rule: 1 of 2 prompts are not built-in prompts"):
        check_rows("builtin_rule", [LAMP, " Human: hi Assistant:"], [{}, {}])
    check_rows("builtin_rule", [LAMP], [{}])
    check_rows("my.py:fn", ["anything"], [{}])  # a user's function: nothing to check up front


def test_loading_a_users_function_and_its_errors(tmp_path):
    good = tmp_path / "rewards.py"
    good.write_text("def length(prompts, answers, rows):\n    return [len(a) for a in answers]\nNOT_CALLABLE = 3\n")
    fn = load_reward_fn(f"{good}:length")
    assert call_reward_fn(fn, "rewards.py:length", ["p", "q"], ["ab", ""], [{}, {}]) == [2.0, 0.0]
    assert load_reward_fn("gsm8k") is gsm8k
    cases = {
        "nope": "unknown reward function; give a built-in one (builtin_rule, builtin_preference, gsm8k, ifeval) "
                "or path/to/file.py:function",
        "ifeval_guarded": "ifeval_guarded: ifeval_guarded moved to bench/ifeval_reward.py: use --reward_fn "
                          "bench/ifeval_reward.py:ifeval_guarded",  # the real-model bench's reward, a file's now
        f"{tmp_path}/missing.py:f": "no such file",
        f"{good}:absent": "defines no 'absent'",
        f"{good}:NOT_CALLABLE": "is not a function",
    }
    for spec, message in cases.items():
        with pytest.raises(UserInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_reward_fn(spec)
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(UserInputError, match="importing .*broken.py failed: ModuleNotFoundError"):
        load_reward_fn(f"{broken}:f")


@pytest.mark.parametrize("returns,message", [
    (lambda a: [1.0], r"returned 1 scores for 2 answers"),
    (lambda a: [1.0, float("nan")], r"returned nan for row 1 \(prompt 'q1'\); scores must be finite"),
    (lambda a: [float("inf"), 1.0], r"returned inf for row 0 \(prompt 'q0'\)"),
    (lambda a: [1.0, "high"], r"returned 'high' \(not a number\) for row 1"),
    (lambda a: None, r"returned NoneType, not a list of 2 scores"),
    # a dict would have given its keys, a string its characters, a set no order: each is refused whole
    (lambda a: {"a": 1.0, "b": 0.0}, r"returned dict, not a list of 2 scores \(one number per answer\)"),
    (lambda a: "10", r"returned str, not a list of 2 scores"),
    (lambda a: {1.0, 0.0}, r"returned set, not a list of 2 scores"),
    (lambda a: 1.0, r"returned float, not a list of 2 scores"),
    (lambda a: (x for x in [1.0, 0.0]), r"returned generator, not a list of 2 scores"),
    (lambda a: [1.0, "1.0"], r"returned '1.0' \(not a number\) for row 1"),  # float("1.0") would have passed
    (lambda a: [[1.0], [0.0]], r"returned \[1.0\] \(not a number\) for row 0"),
    (lambda a: [None, 1.0], r"returned None \(not a number\) for row 0"),
    (lambda a: [1.0, 2j], r"returned 2j \(not a number\) for row 1"),
])
def test_bad_return_values_are_one_clear_line(returns, message):
    with pytest.raises(UserInputError, match=r"--reward_fn f.py:g " + message):
        call_reward_fn(lambda p, a, r: returns(a), "f.py:g", ["q0", "q1"], ["a", "b"], [{}, {}])


def test_one_number_per_answer_in_any_sequence_is_taken():
    import numpy as np
    import torch

    for returned in ([1, 0.5], (True, 0), np.array([1.0, 0.5]), np.float32(1.0), torch.tensor([1.0, 0.5]),
                     [np.float64(1.0), torch.tensor(0.5)]):
        if np.ndim(returned) == 0:  # a scalar is not a list of scores
            with pytest.raises(UserInputError, match="not a list of 2 scores"):
                call_reward_fn(lambda p, a, r: returned, "f.py:g", ["q0", "q1"], ["a", "b"], [{}, {}])
            continue
        scores = call_reward_fn(lambda p, a, r: returned, "f.py:g", ["q0", "q1"], ["a", "b"], [{}, {}])
        assert scores == [1.0, float(list(returned)[1])] and all(type(x) is float for x in scores)
    with pytest.raises(UserInputError, match=r"returned Tensor, not a list of 2 scores"):  # one list per answer
        call_reward_fn(lambda p, a, r: torch.tensor([[1.0], [0.0]]), "f.py:g", ["q0", "q1"], ["a", "b"], [{}, {}])


def test_a_function_that_raises_is_traced_to_its_row():
    def fails_on_b(prompts, answers, rows):
        return [{"a": 1.0}[x] for x in answers]

    with pytest.raises(UserInputError, match=r"raised KeyError: 'b' on row 1 \(prompt 'q1'\)"):
        call_reward_fn(fails_on_b, "f.py:fails_on_b", ["q0", "q1"], ["a", "b"], [{}, {}])
