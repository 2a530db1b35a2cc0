"""Generation options: ``--options`` parsing, typed values, shorthands, help text, and one clear
message per bad value (naming the option and its valid range)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from generation.request.options import OPTIONS, GenerationOptions, OptionError, build_options, options_help, parse_options
from generation.run.vanilla import VanillaGenerator

ROOT = Path(__file__).resolve().parent.parent


def test_typed_values_and_shorthands():
    known, extra = parse_options("num_beams:int=3, temperature:float=0.5,do_sample:bool=true,top_k=7,"
                                 "early_stopping,!static_shapes,length_penalty:int=2")
    assert known == dict(num_beams=3, temperature=0.5, do_sample=True, top_k=7, early_stopping=True,
                         static_shapes=False, length_penalty=2.0)
    assert isinstance(known["length_penalty"], float) and extra == {}
    assert build_options("early_stopping=never,num_beams=2").early_stopping == "never"
    assert build_options("early_stopping=f").early_stopping is False


def test_unknown_typed_keys_pass_through_to_vanilla():
    opts = build_options("diversity_penalty:float=0.5,num_beam_groups:int=2,renormalize_logits:bool=t,num_beams=4")
    assert opts.extra == dict(diversity_penalty=0.5, num_beam_groups=2, renormalize_logits=True)
    fake = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=3, eos_token_id=2))
    kwargs = VanillaGenerator.hf_kwargs(fake, opts, 4)
    assert kwargs["num_beam_groups"] == 2 and kwargs["diversity_penalty"] == 0.5 and kwargs["num_beams"] == 4


def test_keyword_arguments_win_over_the_options_string():
    opts = build_options("num_beams=4,top_p=0.5", num_beams=2, seed=9)
    assert (opts.num_beams, opts.top_p, opts.seed) == (2, 0.5, 9)
    assert GenerationOptions().updated(top_k="5").top_k == 5


@pytest.mark.parametrize("text,words", [
    ("top_p=1.5", ["top_p", "(0, 1]"]),
    ("top_p=0", ["top_p", "(0, 1]"]),
    ("num_beams=0", ["num_beams", ">= 1"]),
    ("num_return_sequences=3,num_beams=2", ["num_return_sequences", "num_beams", "do_sample"]),
    ("temperature=0", ["temperature", "> 0"]),
    ("top_k=-1", ["top_k", ">= 0"]),
    ("repetition_penalty=0", ["repetition_penalty", "> 0"]),
    ("no_repeat_ngram_size=-2", ["no_repeat_ngram_size", ">= 0"]),
    ("min_new_tokens=-1", ["min_new_tokens", ">= 0"]),
    ("max_new_tokens=0", ["max_new_tokens", ">= 1"]),
    ("seed=-3", ["seed", ">= 0"]),
    ("bogus=1", ["unknown option 'bogus'", "--help_options"]),
    ("num_beams=two", ["num_beams", "int"]),
    ("top_k=2.5", ["top_k", "int"]),
    ("do_sample=maybe", ["do_sample", "true/false"]),
    ("early_stopping=sometimes", ["early_stopping", "never"]),
    ("top_k:float=2", ["top_k", "int"]),
    ("x:complex=1", ["unknown type"]),
])
def test_bad_values_get_one_clear_message(text, words):
    with pytest.raises(OptionError) as error:
        build_options(text)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_sampling_may_return_more_sequences_than_beams():
    assert build_options("do_sample,num_return_sequences=4").num_return_sequences == 4


def test_help_lists_every_option_with_type_and_default():
    text = options_help()
    for option in OPTIONS:
        line = next(l for l in text.splitlines() if l.split()[:1] == [option.name])
        assert option.type.__name__ in line and "default" in line and option.help[:20] in line


def test_cli_runs_beam_options(tmp_path):
    """The CLI passes --options through to beam search (bad values: see test_cli.py)."""
    ok = subprocess.run([sys.executable, str(ROOT / "bloom.py"), "--device", "cpu", "--max_length", "12", "--quiet",
                         "--options", "num_beams=3,early_stopping=never,length_penalty:float=0.5,"
                         "no_repeat_ngram_size=2,!ignore_eos", "Hello there"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()
