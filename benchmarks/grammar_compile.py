"""Output-constraint grammars on the real 248K Qwen vocabulary: build, compile, cache and mask costs.

A coding agent's 20 tool schemas (shell, file reading and editing, search, todo lists, web,
notebooks, sub-tasks) as strict tools under tool_choice auto and as a required choice, and a
Pydantic-style JSON answer, compiled the way the engine compiles them (engine/compiled_grammars.py:
the EBNF the API side produces, one worker, the library's threads = half the CPUs, at most 8).
Reports the vocabulary index and the primer grammar (each once per engine), the API-side check
(the structural tag converted to EBNF, rewritten, read back), each compile (median of --runs: each
run a fresh engine compiler, primed, compiling a grammar it has not seen; and the same grammar on
a compiler with no cache, as it would cost without the primer), a cache hit, and the per-token
bitmask fill while matching a rendered call.

  python3 benchmarks/grammar_compile.py --runs 5 --out /tmp/grammar
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


from ninfer.assets.qwen_tokenizer import EMBEDDING_ROWS, build_qwen3_5_tokenizer
from ninfer.contract.constraint import OutputConstraint
from ninfer.engine.compiled_grammars import CompiledGrammars, compile_threads
from ninfer.engine.constraint_state import ConstraintState
from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer, ToolCalls, ToolSchema
from ninfer.frontend.grammar_library import grammar_library
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary
from ninfer.frontend.tokenizer import Tokenizer

S = {"type": "string"}
I = {"type": "integer"}
B = {"type": "boolean"}


def obj(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


AGENT_TOOLS = {
    "bash": obj({"command": S, "timeout": {**I, "maximum": 600000}, "description": S, "run_in_background": B},
                ["command"]),
    "bash_output": obj({"shell_id": S, "filter": S}, ["shell_id"]),
    "kill_shell": obj({"shell_id": S}, ["shell_id"]),
    "read": obj({"file_path": S, "offset": I, "limit": I}, ["file_path"]),
    "write": obj({"file_path": S, "content": S}, ["file_path", "content"]),
    "edit": obj({"file_path": S, "old_string": S, "new_string": S, "replace_all": B},
                ["file_path", "old_string", "new_string"]),
    "multi_edit": obj({"file_path": S, "edits": {"type": "array", "minItems": 1, "items": obj(
        {"old_string": S, "new_string": S, "replace_all": B}, ["old_string", "new_string"])}}, ["file_path", "edits"]),
    "glob": obj({"pattern": S, "path": S}, ["pattern"]),
    "grep": obj({"pattern": S, "path": S, "glob": S,
                 "output_mode": {"enum": ["content", "files_with_matches", "count"]}, "-i": B, "-n": B,
                 "-A": I, "-B": I, "-C": I, "type": S, "head_limit": I, "multiline": B}, ["pattern"]),
    "ls": obj({"path": S, "ignore": {"type": "array", "items": S}}, ["path"]),
    "todo_write": obj({"todos": {"type": "array", "items": obj(
        {"content": {**S, "minLength": 1}, "status": {"enum": ["pending", "in_progress", "completed"]},
         "activeForm": {**S, "minLength": 1}}, ["content", "status", "activeForm"])}}, ["todos"]),
    "web_fetch": obj({"url": {**S, "format": "uri"}, "prompt": S}, ["url", "prompt"]),
    "web_search": obj({"query": {**S, "minLength": 2}, "allowed_domains": {"type": "array", "items": S},
                       "blocked_domains": {"type": "array", "items": S}}, ["query"]),
    "task": obj({"description": S, "prompt": S, "subagent_type": S}, ["description", "prompt", "subagent_type"]),
    "notebook_edit": obj({"notebook_path": S, "cell_id": S, "new_source": S,
                          "cell_type": {"enum": ["code", "markdown"]},
                          "edit_mode": {"enum": ["replace", "insert", "delete"]}}, ["notebook_path", "new_source"]),
    "exit_plan_mode": obj({"plan": S}, ["plan"]),
    "apply_patch": obj({"input": S}, ["input"]),
    "update_plan": obj({"explanation": S, "plan": {"type": "array", "items": obj(
        {"step": S, "status": {"enum": ["pending", "in_progress", "completed"]}}, ["step", "status"])}}, ["plan"]),
    "view_image": obj({"path": S}, ["path"]),
    "ask_user": obj({"question": S, "options": {"type": "array", "items": S, "maxItems": 4}}, ["question"]),
}
ANSWER = obj({"title": S, "year": {**I, "minimum": 1900, "maximum": 2100}, "genres": {"type": "array", "items": S},
              "rating": {"type": "number"}, "watched": B}, ["title", "year", "genres", "rating", "watched"])
CALL = ("<tool_call>\n<function=edit>\n<parameter=file_path>\n/src/app/main.py\n</parameter>\n<parameter=old_string>\n"
        "    return x\n</parameter>\n<parameter=new_string>\n    return x + 1\n</parameter>\n</function>\n</tool_call>")


def tools() -> tuple[ToolSchema, ...]:
    return tuple(ToolSchema(name, schema, f"tools[{i}].function.parameters")
                 for i, (name, schema) in enumerate(AGENT_TOOLS.items()))


def measure(grammars: CompiledGrammars, constraint: OutputConstraint, runs: int) -> dict:
    seconds, unprimed = [], []
    for _ in range(runs):
        compiler = CompiledGrammars(grammars.vocabulary)._get_compiler()  # a new engine's, primed
        started = time.perf_counter()
        compiled = compiler.compile_grammar(constraint.grammar)
        seconds.append(time.perf_counter() - started)
        bare = grammar_library().GrammarCompiler(grammars.vocabulary.info, max_threads=compile_threads(),
                                                 cache_enabled=False)
        started = time.perf_counter()
        bare.compile_grammar(constraint.grammar)
        unprimed.append(time.perf_counter() - started)
    grammars.compile(constraint).result()
    started = time.perf_counter()
    assert grammars.get(constraint) is not None
    hit = time.perf_counter() - started
    return {"compile_ms": 1000 * statistics.median(seconds), "compile_ms_all": [1000 * s for s in seconds],
            "unprimed_compile_ms": 1000 * statistics.median(unprimed), "cache_hit_us": 1e6 * hit,
            "memory_bytes": compiled.memory_size_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/grammar"))
    args = parser.parse_args()
    tokenizer = Tokenizer(build_qwen3_5_tokenizer(), eos_token="<|im_end|>")
    vocabulary = GrammarVocabulary(tokenizer, EMBEDDING_ROWS)
    started = time.perf_counter()
    vocabulary.info
    results: dict = {"cpus": os.cpu_count(), "vocabulary_index_s": time.perf_counter() - started, "cases": {}}
    grammars = CompiledGrammars(vocabulary)
    started = time.perf_counter()
    grammars._get_compiler()  # compiles the primer grammar
    results["primer_ms"] = 1000 * (time.perf_counter() - started)
    end = tokenizer.token_to_id("<|im_end|>")
    cases = {
        "20 strict tools, auto": AnswerFormat(calls=ToolCalls(tools(), required=False)),
        "20 tools, required": AnswerFormat(calls=ToolCalls(tools(), required=True)),
        "JSON answer (5 fields)": AnswerFormat(json=JsonAnswer(ANSWER, "response_format")),
    }
    for name, answer in cases.items():
        started = time.perf_counter()
        constraint = answer.constraint(None)
        check_ms = 1000 * (time.perf_counter() - started)
        row = {"api_check_ms": check_ms, **measure(grammars, constraint, args.runs)}
        if "tools" in name:
            state = ConstraintState(grammars.get(constraint), [end], EMBEDDING_ROWS)
            fills = []
            for token in tokenizer.encode(CALL):
                started = time.perf_counter()
                mask = state.next_token_bitmask()
                fills.append(time.perf_counter() - started)
                assert (int(mask[token // 32]) >> (token % 32)) & 1 and state.accept(token)
            row["mask_fill_us_median"] = 1e6 * statistics.median(fills)
            row["mask_fill_us_max"] = 1e6 * max(fills)
        results["cases"][name] = row
        print(name, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()
                                if k != "compile_ms_all"}))
    grammars.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_compile.json").write_text(json.dumps(results, indent=1))
    lines = [f"CPUs: {results['cpus']}; once per engine: vocabulary index {results['vocabulary_index_s']:.2f} s, "
             f"primer grammar {results['primer_ms']:.0f} ms", "",
             "| grammar | API check ms | compile ms (median) | without the primer ms | cache hit µs "
             "| mask fill µs (median / max) |",
             "|---|---|---|---|---|---|"]
    for name, row in results["cases"].items():
        fill = (f"{row['mask_fill_us_median']:.0f} / {row['mask_fill_us_max']:.0f}" if "mask_fill_us_median" in row
                else "—")
        lines.append(f"| {name} | {row['api_check_ms']:.1f} | {row['compile_ms']:.0f} "
                     f"| {row['unprimed_compile_ms']:.0f} | {row['cache_hit_us']:.0f} | {fill} |")
    (args.out / "grammar_compile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
