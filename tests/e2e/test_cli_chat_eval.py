"""`slimtune chat`, `slimtune eval`, `--version` and `plan --png` through the CLI, on the bundled demo model.

Two runs are trained once for the module, two steps each: a LoRA run on prompt_response data and a
full run on chat data (its paths relative to the folder it trained in). The figures eval reports are
checked against plain transformers (unbatched greedy generate, F.cross_entropy): exact match is 1
on a file whose responses are the model's own greedy answers, and a known fraction otherwise."""

import importlib.metadata
import io
import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import write_jsonl
from e2e_helpers import slimtune
from slimtune import cli, demo
from slimtune.data import dataset as data
from slimtune.model import lora
from slimtune.model.stack import load_model, load_tokenizer

# One xdist worker runs this module (scripts/test.sh: --dist loadgroup), so its module fixture
# (runs) is built once, not once on each worker.
pytestmark = pytest.mark.xdist_group("test_cli_chat_eval")

BASE = demo.ASSETS / "base"
PROMPTS = ["9 + 13 =", "27 + 20 =", "11 + 10 =", "12 plus 7 is", "Tomar lives in"]
LONG = "The sum of 12 and 7 is 19. Tomar is a baker. The sum of 3 and 4 is"  # 25 tokens; the others 5 or 6
NEW_TOKENS = 6
CPU = torch.device("cpu")


def demo_records(count: int) -> list[dict]:
    lines = (demo.ASSETS / "data" / "train.jsonl").read_text().splitlines()[:count]
    return [json.loads(line) for line in lines]


def as_chat(record: dict) -> dict:
    return {"messages": [{"role": "user", "content": record["prompt"]},
                         {"role": "assistant", "content": record["response"]}]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(folder, LoRA run dir, full run dir). The full run trains from `base`, a relative path: eval finds
    it again from another working directory."""
    root = tmp_path_factory.mktemp("chat-eval")
    records = demo_records(32)
    write_jsonl(root / "train.jsonl", records)
    write_jsonl(root / "chat.jsonl", [as_chat(r) for r in records])
    (root / "base").symlink_to(BASE)
    common = "train: {steps: 2, batch_size: 8, lr: 0.03}\nlora: {rank: 4, alpha: 8}\n"
    (root / "lora.yaml").write_text(f"model: {BASE}\ndata: {{path: train.jsonl, max_length: 64, eval_fraction: 0}}\n"
                                    f"method: lora\n{common}output_dir: runs/lora\n")
    (root / "full.yaml").write_text("model: base\ndata: {path: chat.jsonl, format: chat, max_length: 64, "
                                    f"eval_fraction: 0}}\nmethod: full\n{common}output_dir: runs/full\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        for config in ("lora.yaml", "full.yaml"):
            overrides = ["train.lr=1e-3"] if config == "full.yaml" else []
            assert cli.main(["train", config, *overrides, "--no-progress"]) == 0
    return root, root / "runs" / "lora", root / "runs" / "full"


@torch.no_grad()
def greedy(model, tokenizer, ids: list[int], new_tokens: int = NEW_TOKENS) -> str:
    """Plain transformers: one prompt, no padding, greedy."""
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@torch.no_grad()
def mean_loss(model, tokenizer, pairs: list[tuple[list[int], str]]) -> float:
    """F.cross_entropy over each response's tokens and the eos, after its prompt's ids, one example at a time."""
    total, count = 0.0, 0
    for ids, response in pairs:
        answer = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        logits = model(input_ids=torch.tensor([ids + answer])).logits[0]
        total += float(F.cross_entropy(logits[len(ids) - 1 : -1].double(), torch.tensor(answer), reduction="sum"))
        count += len(answer)
    return total / count


def adapted(run_dir: Path):
    model = load_model(BASE, torch.float32, CPU).eval()
    lora.load_peft_adapter(model, run_dir / "adapter")
    return model


# ---------------------------------------------------------------- chat


def test_chat_prompt_answers_with_the_adapter_applied_and_names_the_device(runs):
    root, lora_run, _ = runs
    tok = load_tokenizer(BASE)
    ids = data.encode_prompt(tok, PROMPTS[1])
    tuned, base = greedy(adapted(lora_run), tok, ids), greedy(load_model(BASE, torch.float32, CPU).eval(), tok, ids)
    assert tuned != base, "the adapter does not change this answer: the test could not tell it was applied"
    proc = slimtune("chat", str(lora_run), "--prompt", PROMPTS[1], "--max-new-tokens", str(NEW_TOKENS), cwd=root)
    assert proc.stdout == tuned + "\n"
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("slimtune chat: lora run") and "on cpu (fp32)" in proc.stderr
    assert not (lora_run / "merged").exists()  # the adapter is applied in memory, nothing merged to disk


def test_chat_goes_through_the_template_keeps_the_turns_and_exits_cleanly(runs, capsys, monkeypatch):
    _, _, full_run = runs
    tok = load_tokenizer(full_run / "model")
    model = load_model(full_run / "model", torch.float32, CPU).eval()
    first = [{"role": "user", "content": PROMPTS[0]}]
    answer = greedy(model, tok, data.encode_prompt(tok, data.render_chat_prompt(tok, first, None)))
    turns = first + [{"role": "assistant", "content": answer.strip()}, {"role": "user", "content": PROMPTS[1]}]
    second = greedy(model, tok, data.encode_prompt(tok, data.render_chat_prompt(tok, turns, None)))
    rendered = []  # the conversations the template rendered: the second answer must see the first turns
    render = data.render_chat_prompt
    monkeypatch.setattr(data, "render_chat_prompt", lambda t, messages, template: rendered.append(messages) or
                        render(t, messages, template))
    for ending in ("exit\n", ""):  # "exit", then end of input (Ctrl-D)
        rendered.clear()
        monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n{ending}"))
        assert cli.main(["chat", str(full_run), "--max-new-tokens", str(NEW_TOKENS)]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith(f">>> {answer}\n>>> >>> {second}\n>>> ")
        assert rendered == [first, turns]
        assert "slimtune chat: full run" in captured.err and "chat style" in captured.err

    def interrupted(prompt):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    assert cli.main(["chat", str(full_run)]) == 0  # Ctrl-C at the prompt leaves quietly
    assert "Traceback" not in capsys.readouterr().err


def test_chat_says_a_message_is_not_utf8_and_goes_on_and_a_closed_stdin_is_one_sentence(runs, capsys, monkeypatch):
    _, lora_run, _ = runs
    tok = load_tokenizer(BASE)
    answer = greedy(adapted(lora_run), tok, data.encode_prompt(tok, PROMPTS[1]))
    piped = b"\xff\xfe\n" + PROMPTS[1].encode() + b"\n"  # `printf '\xff\xfe\n...' | slimtune chat RUN`
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(piped), encoding="utf-8", errors="strict"))
    assert cli.main(["chat", str(lora_run), "--max-new-tokens", str(NEW_TOKENS)]) == 0
    captured = capsys.readouterr()
    assert "slimtune: the message is not UTF-8 text (byte 0xff at character 1); send it as UTF-8.\n" in captured.err
    assert captured.out == f">>> >>> {answer}\n>>> \n" and "Traceback" not in captured.err

    monkeypatch.setattr(sys, "stdin", None)  # what Python makes of a closed stdin (`slimtune chat RUN <&-`)
    assert cli.main(["chat", str(lora_run)]) == 2
    assert capsys.readouterr().err == ("slimtune: error: standard input is closed, so chat has no messages to read;"
                                       " give one with --prompt.\n")


# ---------------------------------------------------------------- eval


def test_eval_exact_match_is_one_on_the_models_own_answers_and_compares_the_base(runs, tmp_path, capsys):
    _, lora_run, _ = runs
    tok = load_tokenizer(BASE)
    tuned, base = adapted(lora_run), load_model(BASE, torch.float32, CPU).eval()
    prompts = [PROMPTS[1], LONG, PROMPTS[0], *PROMPTS[2:]]  # batch size 2: 5 and 25 tokens share a generate call
    ids = [data.encode_prompt(tok, p) for p in prompts]
    answers = [greedy(tuned, tok, i).strip() for i in ids]  # written stripped: exact match compares stripped strings
    base_answers = [greedy(base, tok, i).strip() for i in ids]
    write_jsonl(tmp_path / "own.jsonl", [{"prompt": p, "response": a} for p, a in zip(prompts, answers)])
    assert cli.main(["eval", str(lora_run), "--data", str(tmp_path / "own.jsonl"), "--json", "--compare-base",
                     "--batch-size", "2", "--max-new-tokens", str(NEW_TOKENS)]) == 0
    captured = capsys.readouterr()
    found = json.loads(captured.out)
    assert found["model"]["exact_match"] == 1.0
    assert found["base"]["exact_match"] == sum(a == b for a, b in zip(answers, base_answers)) / len(prompts) < 1
    pairs = list(zip(ids, answers))
    assert found["model"]["eval_loss"] == pytest.approx(mean_loss(tuned, tok, pairs), rel=1e-5)
    assert found["base"]["eval_loss"] == pytest.approx(mean_loss(base, tok, pairs), rel=1e-5)
    assert found["model"]["eval_ppl"] == pytest.approx(torch.tensor(found["model"]["eval_loss"]).exp().item())
    assert found["examples"] == found["answers"] == len(prompts) and found["format"] == "prompt_response"
    assert [line.split(":")[0] for line in captured.err.splitlines()] == ["slimtune eval [model]", "slimtune eval [base]"]


def test_eval_of_a_full_run_on_chat_data_from_another_folder(runs, tmp_path, capsys, monkeypatch):
    _, _, full_run = runs
    tok = load_tokenizer(full_run / "model")
    model = load_model(full_run / "model", torch.float32, CPU).eval()

    def answer(turns):
        return greedy(model, tok, data.encode_prompt(tok, data.render_chat_prompt(tok, turns, None)))

    turn = [{"role": "user", "content": PROMPTS[0]}]
    longer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}, *turn]
    write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": turn + [{"role": "assistant", "content": answer(turn)}]},
        {"messages": turn + [{"role": "assistant", "content": "never said"}]},
        {"messages": longer + [{"role": "assistant", "content": answer(longer)}]},  # answered at its last turn
    ])
    write_jsonl(tmp_path / "text.jsonl", [{"text": "12 plus 7 is 19."}])
    monkeypatch.chdir(tmp_path)  # the run's `model: base` is relative to the folder it trained in
    assert cli.main(["eval", str(full_run), "--data", "chat.jsonl", "--compare-base",
                     "--max-new-tokens", str(NEW_TOKENS)]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table if line.strip()}
    assert rows["model"] == ["base"] and "chat: 3 examples" in table[0]
    assert rows["exact"][:2] == ["match", "66.7%"] and rows["exact"][2].endswith("%")
    loss, base_loss = map(float, rows["eval"][1:])
    assert loss != base_loss  # the base is the run's starting model, not the run again
    assert cli.main(["eval", str(full_run), "--data", "text.jsonl", "--json", "--format", "text"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["format"] == "text" and "exact_match" not in found["model"] and found["answers"] is None


def test_a_lora_run_without_its_adapter_folder_loads_its_newest_checkpoint_and_an_adapter_folder_its_base(runs,
                                                                                                          tmp_path):
    import shutil

    from slimtune.serve import inference

    _, lora_run, _ = runs
    copy = tmp_path / "copy"
    shutil.copytree(lora_run, copy, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(copy / "adapter")
    record = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**record, "result": None}))  # as a run killed after its checkpoint
    source = inference.resolve(copy)
    assert source.adapter.name.startswith("step-") and "checkpoint's adapter at step 2" in source.describe()
    ids = torch.tensor([data.encode_prompt(load_tokenizer(BASE), PROMPTS[0])])
    with torch.no_grad():
        torch.testing.assert_close(inference.load(source, "cpu").model(input_ids=ids).logits,
                                   adapted(lora_run)(input_ids=ids).logits)
    alone = inference.resolve(lora_run / "adapter")  # an adapter folder by itself: its base from adapter_config.json
    assert (alone.kind, alone.weights, alone.adapter) == ("adapter", BASE, lora_run / "adapter")


# ---------------------------------------------------------------- export of what the run trained with


def relocated_copy(root: Path, run: Path, name: str, **settings) -> Path:
    """A copy of `run` at root/runs/<name> whose config.yaml records `settings` (as if it had trained with
    them from `root`: output_dir runs/<name>)."""
    import shutil

    import yaml

    copy = root / "runs" / name
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".lock"))
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    for key, value in settings.items():
        section, _, field = key.partition(".")
        if field:
            cfg.setdefault(section, {})[field] = value
        else:
            cfg[key] = value
    (copy / "config.yaml").write_text(yaml.safe_dump({**cfg, "output_dir": f"runs/{name}"}))
    return copy


def test_export_finds_a_relative_base_from_another_folder_and_carries_the_trained_chat_template(runs, tmp_path,
                                                                                               capsys, monkeypatch):
    """A run that named its base by a relative path (`model: base`), exported from another folder, merges
    onto that base, as chat and eval find it (export looked it up from the working directory: refused, or
    merged onto whatever folder of that name was there). A run on chat data exports the template it
    trained with, in the merged folder's tokenizer and the GGUF file; the GGUF's refusals come before
    the merge writes anything."""
    from gguf import GGUFReader

    root, lora_run, full_run = runs
    template = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}{% endfor %}### assistant: "
    copy = relocated_copy(root, lora_run, "lora-relative", model="base", **{"data.format": "chat",
                                                                          "data.chat_template": template})
    monkeypatch.chdir(tmp_path)  # no ./base here
    assert cli.main(["export", str(copy), "--merge", "--gguf", str(tmp_path / "no" / "x.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (copy / "merged").exists()
    assert cli.main(["export", str(copy), "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = load_model(tmp_path / "merged", torch.float32, CPU).eval()
    ids = torch.tensor([data.encode_prompt(load_tokenizer(BASE), PROMPTS[0])])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(lora_run)(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert load_tokenizer(tmp_path / "merged").chat_template == template
    assert load_tokenizer(BASE).chat_template != template  # the base's own is not what was trained
    # A full run on chat data with no template of its own: its model/ and its GGUF carry the one it trained with.
    trained = data.resolve_template(load_tokenizer(BASE), None)
    assert load_tokenizer(full_run / "model").chat_template == trained
    assert cli.main(["export", str(full_run), "--gguf", str(tmp_path / "full.gguf")]) == 0
    field = GGUFReader(tmp_path / "full.gguf").get_field("tokenizer.chat_template")
    assert field is not None and bytes(field.parts[field.data[0]]).decode() == trained


def test_a_merged_export_is_written_in_the_base_models_dtype(runs, tmp_path, capsys):
    """A bf16 base's merged folder is bf16 (it was written in float32, twice the base's size): the adapter
    merged in float32 onto the base's weights, then rounded once, as PEFT's merge on a bf16 model leaves it."""
    from safetensors.torch import load_file

    from slimtune.model.stack import stored_float_dtype

    root, lora_run, _ = runs
    base16 = root / "base16"
    if not base16.exists():
        load_model(BASE, torch.bfloat16, CPU).save_pretrained(str(base16))
        load_tokenizer(BASE).save_pretrained(str(base16))
    copy = relocated_copy(root, lora_run, "lora-bf16", model="base16")
    assert cli.main(["export", str(copy), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert "in bfloat16, as the base" in capsys.readouterr().out
    assert stored_float_dtype(tmp_path / "merged") == torch.bfloat16
    expected = load_model(base16, torch.float32, CPU)
    lora.load_peft_adapter(expected, lora_run / "adapter")
    lora.merge(expected)
    written = load_file(str(tmp_path / "merged" / "model.safetensors"))
    compared = [name for name in expected.state_dict() if name in written]  # (a tied head is written once)
    assert len(compared) >= len(written) - 1 and len(compared) > 10
    for name in compared:
        assert torch.equal(written[name], expected.state_dict()[name].to(torch.bfloat16)), name


def test_a_run_trained_with_an_inline_chat_template_longer_than_a_file_name_chats(runs, capsys):
    """data.chat_template may be the template's text: looked up as a path it is too long for a file name
    (OSError: File name too long), which chat and eval raised as a traceback."""
    root, lora_run, _ = runs
    template = "{#- " + "an inline template, longer than any file name may be; " * 6 + "-#}" + \
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    copy = relocated_copy(root, lora_run, "lora-inline", **{"data.format": "chat", "data.chat_template": template})
    assert cli.main(["chat", str(copy), "--prompt", PROMPTS[0], "--max-new-tokens", "2"]) == 0
    assert "slimtune chat: lora run" in capsys.readouterr().err  # answered (an answer may be empty: eos first)


# ---------------------------------------------------------------- --version and plan --png


def test_version_is_the_installed_one_else_pyproject_s(capsys, monkeypatch):
    proc = slimtune("--version", cwd=Path.cwd())
    assert proc.stdout == f"slimtune {importlib.metadata.version('slimtune')}\n"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    pyproject = tomllib.loads((Path(cli.__file__).parents[1] / "pyproject.toml").read_text())
    assert stop.value.code == 0 and capsys.readouterr().out == f"slimtune {pyproject['project']['version']}\n"


@pytest.mark.parametrize("as_json", [False, True])
def test_plan_png_hands_the_plans_machine_and_title_to_plan_picture(as_json, tmp_path, capsys, monkeypatch):
    import types

    import slimtune.planning
    from slimtune.planning import planner

    calls = []
    picture = types.ModuleType("slimtune.planning.picture")
    picture.write_png = lambda results, machine, path, title: calls.append((results, machine, path, title)) or \
        Path(path)
    checked = []
    picture.check_target = lambda path: checked.append(path) or Path(path)  # the path, before any plan is weighed
    monkeypatch.setitem(sys.modules, "slimtune.planning.picture", picture)
    monkeypatch.setattr(slimtune.planning, "picture", picture, raising=False)
    results = ["a plan"]
    monkeypatch.setattr(planner, "plan", lambda *a, **k: (checked or pytest.fail("weighed before the check")) and results)
    monkeypatch.setattr(planner, "table", lambda found, title, machine, detail=False: f"TABLE {title}")
    monkeypatch.setattr(planner, "to_json", lambda found: "[]")
    png = str(tmp_path / "plan.png")
    argv = ["plan", "--model", "Llama-3.2-1B", "--gpu", "rtx4090", "--host-ram", "64GiB", "--disk", "1TB", "--png", png]
    assert cli.main(argv + ["--json"] * as_json) == 0
    (found, machine, path, title), = calls
    assert found is results and isinstance(machine, planner.Machine) and path == png
    assert title.startswith("slimtune plan: Llama-3.2-1B, lora") and machine.gpu.name in title
    captured = capsys.readouterr()
    said = captured.err if as_json else captured.out
    assert f"plan picture written to {png}\n" in said
    assert captured.out == ("[]\n" if as_json else f"TABLE {title}\nplan picture written to {png}\n")


# ---------------------------------------------------------------- one sentence for bad input


@pytest.mark.parametrize("argv, words", [
    (["chat", "{tmp}/nowhere"], "does not exist"),
    (["chat", "{tmp}/empty"], "is neither a slimtune run (config.yaml), an adapter"),
    (["chat", "{tmp}/file.txt"], "is a file"),
    (["chat", "{lora}", "--temperature", "-0.5"], "--temperature must be 0 (greedy) or a positive number"),
    (["chat", "{lora}", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["chat", "{lora}", "--system", "be brief"], "--system needs the chat style"),
    (["chat", "{tmp}/no-adapter"], "holds no adapter/ and no intact checkpoint"),
    (["chat", "{lora}", "--prompt", "a\udcff\udcfe"], "--prompt is not UTF-8 text (byte 0xff at character 2)"),  # argv
    (["eval", "{lora}", "--data", "{tmp}/bad.jsonl"], "bad.jsonl line 2: not valid JSON"),
    (["eval", "{lora}", "--data", "{tmp}/fields.jsonl"], "fields.jsonl' has a field 'response' (its fields: answer, prompt); name the one to use with data.response_field"),
    (["eval", "{lora}", "--data", "{tmp}/missing.jsonl"], "does not exist"),
    (["eval", str(BASE), "--data", "{tmp}/fields.jsonl", "--compare-base"], "has no base model to compare with"),
    (["eval", "{lora}", "--data", "{tmp}/bad.jsonl", "--batch-size", "0"], "--batch-size must be positive"),
    (["eval", "{lora}", "train.steps=3", "--data", "{tmp}/fields.jsonl"], "'train.steps=3': eval takes data.* settings"),
    (["eval", "{lora}", "data.response_fild=answer", "--data", "{tmp}/fields.jsonl"],
     "unknown key 'data.response_fild' on the command line (did you mean 'data.response_field'?)"),
    (["eval", "{lora}", "data.eval_split=test", "--data", "{tmp}/fields.jsonl"],
     "'data.eval_split=test': eval scores all of --data, held out nothing; name the file with --data, and a split"),
    (["eval", "{lora}", "data.eval_fraction=0.5", "--data", "{tmp}/fields.jsonl"], "'data.eval_fraction=0.5': eval"),
    (["eval", "{lora}", "data.split=test", "--data", "{tmp}/fields.jsonl"],
     "data.split names a split or subset of a Hub dataset or a dataset folder, but --data '"),
    (["export", "{tmp}/notarun", "--merge"], "notarun/config.yaml is not a slimtune run's config (it names no `model`)"),
    (["export", "{tmp}/badyaml", "--gguf", "{tmp}/x.gguf"], "badyaml/config.yaml is not readable YAML"),
])
def test_bad_input_ends_in_one_sentence(runs, tmp_path, capsys, argv, words):
    _, lora_run, _ = runs
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("hi")
    (tmp_path / "no-adapter").mkdir()
    (tmp_path / "no-adapter" / "config.yaml").write_text((lora_run / "config.yaml").read_text())
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    write_jsonl(tmp_path / "fields.jsonl", [{"prompt": "a", "answer": "b"}])
    for name, text in (("notarun", "foo: 1\n"), ("badyaml", "model: [a\n")):  # another project's config.yaml
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(text)
    argv = [a.format(tmp=tmp_path, lora=lora_run) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("slimtune: error: ") and words in err, err
    assert err.strip().count("\n") == 0 and "Traceback" not in err


def test_eval_reads_a_file_whose_fields_are_named_otherwise_than_the_run_s(runs, tmp_path, capsys):
    """`slimtune eval RUN data.response_field=answer --data f.jsonl`: the run's field names were the only
    ones eval read (found by a newcomer walkthrough)."""
    _, lora_run, _ = runs
    write_jsonl(tmp_path / "fields.jsonl", [{"question": PROMPTS[0], "answer": "b"}])
    assert cli.main(["eval", str(lora_run), "data.prompt_field=question", "data.response_field=answer", "--data",
                     str(tmp_path / "fields.jsonl"), "--json", "--max-new-tokens", "2"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["examples"] == found["answers"] == 1 and 0.0 <= found["model"]["exact_match"] <= 1.0


def test_a_device_that_is_not_one_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["chat", str(BASE), "--device", "gpu"])
    assert stop.value.code == 2 and "'gpu' is not auto, cpu, cuda or cuda:N" in capsys.readouterr().err
