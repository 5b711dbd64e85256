"""EngineArgs is where an engine option is spelled: every command that starts an engine takes its
flags from the fields, with the fields' defaults, and LLM() forwards to it."""
from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

import pytest

from pagedllm.engine.arg_utils import EngineArgs, cli_fields
from pagedllm.entrypoints.chat_cli import _backend
from pagedllm.entrypoints.cli import build_parser

# each command that starts an engine in its process, and the flag fields it takes
ENGINE_COMMANDS = {("serve",): None, ("bench", "latency"): None, ("bench", "throughput"): None,
                   ("chat",): None, ("complete",): None, ("run", "x"): None,
                   ("doctor",): ("dtype", "device", "max_model_len")}


def _actions(argv: tuple[str, ...]) -> dict[str, argparse.Action]:
    parser = build_parser()
    for word in argv:
        if word == "x":  # a positional, not a sub-command
            break
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return {a.dest: a for a in parser._actions}


@pytest.mark.parametrize("argv", list(ENGINE_COMMANDS))
def test_each_engine_command_takes_the_fields_flags_with_their_defaults_and_help(argv):
    actions = _actions(argv)
    for f in cli_fields(ENGINE_COMMANDS[argv]):
        action = actions[f.name]
        assert action.default == f.default and action.help == f.metadata["help"], (argv, f.name)
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        if f.metadata["choices"] is not None:
            assert tuple(action.choices) == tuple(f.metadata["choices"]), (argv, f.name)


def test_parsed_defaults_build_the_default_engine_args():
    args = build_parser().parse_args(["bench", "latency", "--model", "m"])
    assert EngineArgs.from_cli_args(args, "m") == EngineArgs(model="m")
    args = build_parser().parse_args(["bench", "latency", "-tp", "2", "--no-enable-prefix-caching",
                                      "--max-num-seqs", "8", "--quantization", "int8"])
    built = EngineArgs.from_cli_args(args, "m")
    assert (built.tensor_parallel_size, built.enable_prefix_caching, built.max_num_seqs,
            built.quantization) == (2, False, 8, "int8")


def test_a_bad_flag_value_is_refused_naming_its_field():
    args = build_parser().parse_args(["complete", "--max-num-seqs", "0", "hi"])
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int, got 0"):
        _backend(args)


def test_an_engine_flag_with_url_is_refused_by_name():
    args = build_parser().parse_args(["chat", "--url", "http://127.0.0.1:1/v1", "-tp", "2",
                                      "--device", "cpu"])
    with pytest.raises(ValueError, match=r"--device, --tensor-parallel-size set up the "
                                         r"in-process engine"):
        _backend(args)


def test_llm_signature_is_engine_args_fields():
    from pagedllm.llm import LLM

    params = inspect.signature(LLM).parameters
    names = [f.name for f in fields(EngineArgs)]
    assert list(params)[:len(names)] == names and list(params)[-1] == "kwargs"
    for f in fields(EngineArgs)[1:]:
        assert params[f.name].default == f.default and params[f.name].kind is \
            inspect.Parameter.KEYWORD_ONLY, f.name


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'; supported: "):
        EngineArgs.from_kwargs("m", max_num_seq=4)


def test_lora_options_are_fields_checked_by_name():
    args = build_parser().parse_args(["bench", "latency", "--enable-lora", "--max-loras", "3",
                                      "--max-lora-rank", "8", "--max-cpu-loras", "4"])
    built = EngineArgs.from_cli_args(args, "m")
    assert built.lora_config() is not None
    assert (built.lora_config().max_loras, built.lora_config().max_lora_rank,
            built.lora_config().cpu_loras) == (3, 8, 4)
    assert EngineArgs(model="m").lora_config() is None  # enable_lora off by default
    for kwargs, match in [({"max_loras": 0}, "max_loras must be a positive int"),
                          ({"max_lora_rank": -1}, "max_lora_rank must be a positive int"),
                          ({"max_loras": 2, "max_cpu_loras": 1},
                           "max_cpu_loras \\(1\\) must be >= max_loras \\(2\\)")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(model="m", enable_lora=True, **kwargs)
    # adapters are split over tensor-parallel ranks as their base layers are
    assert EngineArgs(model="m", enable_lora=True, tensor_parallel_size=2,
                      pipeline_parallel_size=2).lora_config() is not None

