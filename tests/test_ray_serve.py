"""Ray Serve replicas (looped_spec/server/replicas.py): arguments, the application, the config file, and two real
CPU replicas behind Ray's HTTP proxy driven with the official openai client (a replica killed mid-load included)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray.serve.schema import ServeDeploySchema
from server_utils import ServerThread, ray_subprocess_env

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.server.replicas import DEPLOYMENT_NAME, build_application, parse_args

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILE = ROOT / "examples" / "ray_serve.yaml"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):", "def read_file(path):"]


def test_arguments_are_checked_and_errors_name_the_field():
    with pytest.raises(ValueError, match="num_replica: Extra inputs"):
        parse_args({"num_replica": 2})
    with pytest.raises(ValueError, match="num_replicas: a fixed count excludes autoscaling"):
        parse_args({"num_replicas": 2, "max_replicas": 4})
    with pytest.raises(ValueError, match="max_replicas: autoscaling needs"):
        parse_args({"target_ongoing_requests": 8})
    with pytest.raises(ValueError, match="min_replicas=3 exceeds max_replicas=2"):
        parse_args({"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValueError, match="engine: .*max_batch_sise"):
        build_application({"engine": {"max_batch_sise": 8}})  # checked before any replica starts
    with pytest.raises(ValueError, match="threads: Input should be greater than or equal to 0"):
        parse_args({"threads": -1})


def test_a_family_registered_in_this_process_only_is_refused_before_ray_starts(tmp_path):
    """Each replica is a process of its own: a family it cannot find (registered here, not installed with an entry
    point) would fail every replica, retried by Ray; the driver says so first."""
    sys.path.insert(0, str(ROOT / "examples"))
    from custom_family import make_toy_checkpoint

    folder = make_toy_checkpoint(tmp_path / "toy")
    with pytest.raises(ValueError, match=r"model_type 'toy_looped' is registered in this process only.*entry point"):
        parse_args({"model": str(folder)}).check_before_start()  # what `looped-spec serve --replicas` runs first
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "nobody_registered_this"}))
    with pytest.raises(ValueError, match=r"unknown model_type 'nobody_registered_this'"):
        parse_args({"model": str(folder)}).check_before_start()


def test_an_adapter_option_of_a_bad_value_is_refused_before_ray_starts():
    """A value the family refuses (not only a misspelt name) would fail every replica as it loads the model, retried
    by Ray; the driver checks it against config.json first, with the family's own message."""
    for options, message in (
        ({"num_steps": "twelve"}, r"adapter option num_steps='twelve' must be a positive integer"),
        ({"num_steps": 0}, r"adapter option num_steps=0"),
        ({"exit_criterion": "entropy"}, r"adapter option exit_criterion='entropy': use 'kl' or 'latent'"),
        ({"exit_threshold": "low"}, r"adapter option exit_threshold='low' must be a finite number"),
        ({"num_step": 12}, r"adapter option num_step: not an option of huginn_raven.*'num_steps'"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_args({"model": "tiny-huginn", "engine": {"adapter_options": options}}).check_before_start()
    good = parse_args({"model": "tiny-huginn", "engine": {"adapter_options": {"num_steps": 12}}})
    assert good.check_before_start().adapter_options == {"num_steps": 12}


def test_application_options_follow_the_arguments():
    fixed = build_application({"num_replicas": 2, "max_queued": 4, "threads": 2, "engine": {"max_batch_size": 8}})
    deployment = fixed._bound_deployment
    assert deployment.name == DEPLOYMENT_NAME and deployment.num_replicas == 2
    # a replica is sent its batch; up to max_queued more wait in Ray's queue, beyond that Ray answers 429
    assert deployment.max_ongoing_requests == 8
    config = deployment._deployment_config
    assert config.max_queued_requests == 4
    assert (config.backpressure_config.status_code, config.backpressure_config.retry_after_s) == (429, 1)
    assert deployment.ray_actor_options == {"num_cpus": 2, "num_gpus": 0}
    scaled = build_application({"min_replicas": 0, "max_replicas": 3, "target_ongoing_requests": 4})
    autoscaling = scaled._bound_deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (0, 3, 4)
    on_gpu = build_application({"engine": {"device": "cuda"}})._bound_deployment
    assert on_gpu.ray_actor_options["num_gpus"] == 1 and on_gpu.num_replicas == 1
    assert parse_args({}).log_level == "info" and parse_args({"log_level": "debug"}).log_level == "debug"
    with pytest.raises(ValueError, match="log_level"):
        parse_args({"log_level": "loud"})


def test_config_file_is_a_valid_serve_config_and_builds_the_application():
    """examples/ray_serve.yaml: what `serve run` and KubeRay's serveConfigV2 take (Ray's own schema), buildable."""
    config = ServeDeploySchema(**yaml.safe_load(CONFIG_FILE.read_text()))
    (app,) = config.applications
    module, name = app.import_path.split(":")
    builder = getattr(__import__(module, fromlist=[name]), name)
    built = builder(app.args)  # what `serve run` does with an application builder and its args
    assert built._bound_deployment.name == DEPLOYMENT_NAME
    assert built._bound_deployment._deployment_config.autoscaling_config.max_replicas == app.args["max_replicas"]


def test_replica_app_labels_metrics_names_itself_and_reports_readiness():
    """The single-process app as a replica runs it: a replica label on every series, a header, /health readiness."""
    waiting: list[str | None] = ["deployment updating (1 replicas running)"]

    async def readiness() -> str | None:
        return waiting[0]

    engine = LoopedSpecEngine("tiny-ouro", speculation="off")
    with ServerThread(engine, "tiny-ouro", replica="r7", readiness=readiness) as server:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "updating" in health.json()["status"]
        assert health.headers["x-looped-spec-replica"] == "r7"
        waiting[0] = None
        assert httpx.get(server.url + "/health").json() == {"status": "ok", "replica": "r7"}
        body = {"model": "tiny-ouro", "prompt": "def f(", "max_tokens": 2}
        httpx.post(server.url + "/v1/completions", json=body).raise_for_status()
        families = list(text_string_to_metric_families(httpx.get(server.url + "/metrics").text))
        samples = [s for f in families for s in f.samples]
        assert samples and all(s.labels.get("replica") == "r7" for s in samples)
        assert any(s.name == "looped_spec:request_success_total" and s.value == 1 for s in samples)


# --- two real replicas through Ray's proxy -------------------------------------------------------------------


def _free_port(then_free: int = 0) -> int:
    """A free TCP port on 127.0.0.1 whose next `then_free` ports are free too."""
    import socket

    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        try:
            for offset in range(1, then_free + 1):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port


def _processes(key: int, field: int) -> dict[int, str]:
    """pid -> process title of the live processes whose /proc stat `field` is `key` (3: parent, 5: session)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[field - 2]) == key and fields[0] != "Z":
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, IndexError, UnicodeDecodeError, ValueError):
            continue
    return found


def _descendants(root: int) -> dict[int, str]:
    found, frontier = {}, [root]
    while frontier:
        children = _processes(frontier.pop(), 3)
        frontier += [pid for pid in children if pid not in found]
        found |= children
    return found


def _replica_metrics(port: int) -> dict[str, float] | None:
    """One replica's own metrics endpoint: {replica: its id, running: requests in its batch}; None if it is down."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.TransportError:
        return None
    found: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "looped_spec:num_requests_running":
                found |= {"replica": sample.labels["replica"], "running": sample.value}
            if sample.name == "looped_spec:request_success_total" and sample.labels["finished_reason"] != "abort":
                found["finished"] = found.get("finished", 0) + sample.value
    return found or None


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def offline_greedy():
    """Offline greedy text per (prompt, max_tokens): plain decoding, no server, no speculation. A length asked for the
    first time is decoded for every prompt of PROMPTS at once, in one batch (five 400-token decodings one by one took
    about 6 s of the Ray test)."""
    engine = LoopedSpecEngine("tiny-ouro", speculation="off")
    cache: dict = {}

    def text(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in cache:
            prompts = list(dict.fromkeys([prompt, *PROMPTS]))
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for each, out in zip(prompts, engine.generate(prompts, params)):
                cache[each, max_tokens] = out.text
        return cache[prompt, max_tokens]

    yield text
    engine.close()


@pytest.mark.slow
def test_two_replicas_through_the_ray_proxy(offline_greedy, tmp_path, ray_cluster_turn):
    port = _free_port()
    metrics_port = _free_port(then_free=1)  # replica r serves its metrics on metrics_port + r
    env = ray_subprocess_env()
    log = (tmp_path / "server.log").open("w")
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "looped_spec.cli",
            "serve",
            "tiny-ouro",
            "--replicas",
            "2",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--api-key",
            "sekret",
            "--max-batch-size",
            "8",
            "--max-queued",
            "24",
            "--log-level",
            "warning",
            "--chat-template",
            str(template),
        ],  # fmt: skip
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    # the offline references every check below compares with, decoded while Ray starts the replicas
    decoding = ThreadPoolExecutor(1)
    references = decoding.submit(lambda: [offline_greedy(PROMPTS[0], n) for n in (12, 48, 400, 8)])
    try:
        _wait(lambda: server.poll() is None and _health(url) == "ok", 150, "both replicas ready")
        references.result()
        _check_serving(url, metrics_port, offline_greedy)
        _check_chat_template(url)
        _check_backpressure(url, offline_greedy)
        _check_replica_killed_mid_load(url, server.pid, metrics_port, offline_greedy)
    except BaseException:
        log.flush()
        print((tmp_path / "server.log").read_text()[-6000:])
        raise
    finally:
        decoding.shutdown()  # after a failure too, the references' thread is done before the fixture closes its engine
        server.send_signal(signal.SIGTERM)  # the CLI deletes the application and shuts its local Ray cluster down
        try:
            server.wait(timeout=60)
        finally:
            time.sleep(1)
            leftovers = _processes(server.pid, 5)  # anything the server's session started still running
            if server.poll() is None or leftovers:
                os.killpg(server.pid, signal.SIGKILL)
            log.close()
    assert server.returncode == 0 and not leftovers, leftovers


CHAT_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"


def _check_chat_template(url: str) -> None:
    """Every replica renders chat with the server's --chat-template (the file's text reached each), through /tokenize
    (open without the API key, as in vLLM)."""
    from looped_spec.engine.inputs import load_tokenizer
    from looped_spec.models import shipped_model_path

    tokenizer = load_tokenizer(shipped_model_path("tiny-ouro"))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    replicas = set()
    for _ in range(64):  # Ray picks a replica at random: until both have answered
        answer = httpx.post(url + "/tokenize", json=body, timeout=30)
        assert tokenizer.decode(answer.json()["tokens"]) == "<<user>> hi\n"
        replicas.add(answer.headers["x-looped-spec-replica"])
        if len(replicas) == 2:
            break
    assert len(replicas) == 2, replicas


def _health(url: str) -> str | None:
    try:
        response = httpx.get(url + "/health", timeout=5)
    except httpx.TransportError:
        return None
    return response.json().get("status") if response.headers.get("content-type") == "application/json" else None


def _client(url: str, key: str = "sekret") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, timeout=120, max_retries=0)


async def _complete(client, prompt: str, max_tokens: int, stream: bool) -> tuple[str | None, str]:
    """(the replica that answered, the text) of one greedy completion."""
    kwargs = dict(model="tiny-ouro", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    raw = await client.completions.with_raw_response.create(stream=stream, **kwargs)
    replica = raw.headers.get("x-looped-spec-replica")
    if not stream:
        return replica, raw.parse().choices[0].text
    text = ""
    async for chunk in raw.parse():
        text += "".join(choice.text for choice in chunk.choices)
    return replica, text


def _check_serving(url: str, metrics_port: int, offline_greedy) -> None:
    # the API key is enforced through the proxy (/health and /metrics stay open)
    assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401

    async def denied():
        async with _client(url, key="wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.completions.create(model="tiny-ouro", prompt="x", max_tokens=1)

    asyncio.run(denied())

    async def load():
        jobs = [(PROMPTS[i % len(PROMPTS)], 12, i % 2 == 0) for i in range(16)]
        async with _client(url) as client:
            answers = await asyncio.gather(*(_complete(client, p, n, stream) for p, n, stream in jobs))
        return jobs, answers

    jobs, answers = asyncio.run(load())
    for (prompt, max_tokens, _), (_, text) in zip(jobs, answers):
        assert text == offline_greedy(prompt, max_tokens), prompt
    replicas = {replica for replica, _ in answers}
    assert len(replicas) == 2, f"one replica served every request: {replicas}"
    # each replica's own metrics endpoint: labelled by replica, counting what that replica served
    seen = [_replica_metrics(metrics_port + rank) for rank in range(2)]
    assert {m["replica"] for m in seen} == replicas
    assert sum(m["finished"] for m in seen) == len(jobs) and all(m["finished"] > 0 for m in seen)


def _check_backpressure(url: str, offline_greedy) -> None:
    """A burst beyond both replicas' batches (2 x 8) and Ray's queue (--max-queued 24): the requests beyond are
    answered 429 with Retry-After, as the single server answers them; every other one in full."""
    jobs = [(PROMPTS[i % len(PROMPTS)], 48) for i in range(96)]

    async def burst():
        async with _client(url) as client:
            return await asyncio.gather(*(_complete(client, p, n, False) for p, n in jobs), return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert refused, "no request was refused beyond the queue"
    assert all(r.response.headers.get("retry-after") == "1" for r in refused)
    answered = [(job, r) for job, r in zip(jobs, results) if not isinstance(r, openai.RateLimitError)]
    assert len(answered) >= 16, f"only {len(answered)} of {len(jobs)} answered"
    for (prompt, max_tokens), result in answered:
        assert not isinstance(result, BaseException), result
        assert result[1] == offline_greedy(prompt, max_tokens)


def _check_replica_killed_mid_load(url: str, server_pid: int, metrics_port: int, offline_greedy) -> None:
    before = {_replica_metrics(metrics_port + rank)["replica"] for rank in range(2)}
    long_tokens = 400  # seconds of work each: still running when the replica is killed

    async def load():
        async with _client(url) as client:
            return await _killing(client)

    async def _killing(client):
        jobs, tasks = [], []

        def more(count: int) -> None:
            for i in range(len(jobs), len(jobs) + count):
                jobs.append((PROMPTS[i % len(PROMPTS)], long_tokens, i % 2 == 0))
                tasks.append(asyncio.ensure_future(_complete(client, *jobs[-1])))

        more(8)
        # kill a replica (the one with local rank 0) while both have requests in their batch
        victim_metrics = _replica_metrics(metrics_port)
        replicas = [pid for pid, title in _descendants(server_pid).items() if title.startswith("ray::ServeReplica")]
        assert len(replicas) == 2, replicas
        victim = next(pid for pid in replicas if _listens_on(pid, metrics_port))

        seen: list = []  # each replica's running requests, as the last poll read them

        def both_busy() -> bool:
            seen[:] = [(_replica_metrics(metrics_port + r) or {}).get("running") for r in range(2)]
            return all(seen)

        # Ray's router may send a burst to one replica: more requests until both hold some (up to 24)
        busy = False
        for _ in range(6):
            try:
                busy = await asyncio.to_thread(_wait, both_busy, 10, "both replicas busy")
                break
            except AssertionError:
                more(4 if len(jobs) < 24 else 0)
        assert busy, f"both replicas busy: not within 60 s of {len(jobs)} requests"
        # killed right after the poll that found it busy (a second read of its metrics first left time for its
        # requests to finish on a loaded machine: the victim then ran none)
        os.kill(victim, signal.SIGKILL)
        running = seen[0]
        assert running, "the victim ran no request when it was killed"
        done, pending = await asyncio.wait(tasks, timeout=120)
        assert not pending, "a request hung after its replica died"
        return jobs, [task.exception() or task.result() for task in tasks], victim_metrics["replica"]

    jobs, results, victim = asyncio.run(load())
    # a request in flight on the killed replica fails with a clean error, or Ray's router sends it again to the other
    # replica (it does so for a request whose replica died before acknowledging it), where it runs whole: which one
    # happens is Ray's timing, so the test asks that each request be one or the other
    failed = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(r, (openai.APIConnectionError, openai.InternalServerError)) for r in failed), failed
    for (prompt, max_tokens, _), result in zip(jobs, results):
        # a request that succeeded is whole, wherever it ran: one that ran on the victim finished before it died (on
        # a fast machine a request of the first burst may finish about as the victim is killed), none comes back cut
        # short
        if not isinstance(result, BaseException):
            _, text = result
            assert text == offline_greedy(prompt, max_tokens)
    # the replica is replaced: two replicas again, one of them new; later requests succeed
    after = _wait(lambda: _replica_set(metrics_port) if len(_replica_set(metrics_port)) == 2 else None, 120,
                  "a replacement replica")  # fmt: skip
    assert victim not in after and len(after - before) == 1
    _wait(lambda: _health(url) == "ok", 60, "the deployment healthy again")

    async def later():
        async with _client(url) as client:
            return await asyncio.gather(*(_complete(client, p, 8, False) for p in PROMPTS))

    for prompt, (_, text) in zip(PROMPTS, asyncio.run(later())):
        assert text == offline_greedy(prompt, 8)


def _replica_set(metrics_port: int) -> set[str]:
    return {m["replica"] for m in (_replica_metrics(metrics_port + r) for r in range(2)) if m}


def _listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` holds a listening TCP socket on `port` (its /proc entries, no psutil)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A" and fields[9] in inodes:
                return True
    return False


def test_serve_replica_flags_are_checked_before_ray_starts(capsys):
    """`looped-spec serve --replicas ...` errors name the flag and come before any cluster starts (exit 2)."""
    from looped_spec.cli import main

    cases = [
        (["--replicas", "0"], "--replicas: Input should be greater than or equal to 1"),
        (["--replicas", "2", "--max-replicas", "3"], "--replicas: a fixed count excludes autoscaling (--max-replicas)"),
        (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas=3 exceeds --max-replicas=2"),
        (["--min-replicas", "1"], "error: --max-replicas: autoscaling needs"),  # no stray "args:" before it
        (["--replicas", "2", "--max-batch-size", "0"], "--max-batch-size 0: Input should be greater than or equal"),
        (["--replicas", "2", "--speculation", "off", "--control", '{"hysteresis": 0.5}'],
         "--control {'hysteresis': 0.5}: only with --speculation adaptive"),
        # what a replica would fail on (retried by Ray, then its traceback) is checked on the driver
        (["--replicas", "1", "--preset", "nonexistent"], "nonexistent: no such preset file or shipped preset"),
        (["--replicas", "2", "--metrics-port", "65535"], "2 replicas serve /metrics on ports up to 65536"),
        (["--replicas", "2", "--max-queued", "0"], "--max-queued: Input should be greater than or equal to 1"),
        (["--max-replicas", "2", "--target-ongoing-requests", "inf"], "--target-ongoing-requests: Input should be a "
         "finite number"),
    ]  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        cases.append((["--replicas", "1", "--device", "cuda"], "no CUDA device here, and a local Ray cluster"))
    for flags, message in cases:
        assert main(["serve", "tiny-ouro", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Value error" not in err, err
    assert main(["serve", "no-such-model", "--replicas", "2"]) == 2
    assert "no-such-model: not a checkpoint folder" in capsys.readouterr().err


def test_serve_replicas_pass_the_log_level(monkeypatch):
    """`--log-level` reaches each replica (its own process: it sets its looped-spec logging from the arguments)."""
    from looped_spec.cli import main

    started = {}
    monkeypatch.setattr("looped_spec.server.replicas.run_replicas", lambda args, host, port: started.update(args=args))
    assert main(["serve", "tiny-ouro", "--replicas", "2", "--log-level", "debug"]) == 0
    assert started["args"].log_level == "debug"
    assert build_application(started["args"])._bound_deployment.init_args[0]["log_level"] == "debug"


def test_each_replica_writes_its_own_controller_trace(tmp_path):
    """Every replica runs its own controller: with one trace_path each opened the same file for writing, truncating and
    overwriting the others' lines. Each replica's engine options name a file of its own, `<stem>.<replica>.jsonl`."""
    from looped_spec.server.replicas import replica_engine_options

    trace = tmp_path / "trace.jsonl"
    engine = {"trace_path": str(trace), "max_batch_size": 2}
    assert replica_engine_options({"max_batch_size": 2}, "replica#a1", 0) == {"max_batch_size": 2, "seed": 0}
    for rank, tag in enumerate(("replica#a1", "replica#b2")):
        options = replica_engine_options(engine, tag, rank)
        assert {k: v for k, v in options.items() if k != "trace_path"} == {"max_batch_size": 2, "seed": rank}
        with LoopedSpecEngine("tiny-ouro", **options) as replica:
            replica.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["trace.replica-a1.jsonl", "trace.replica-b2.jsonl"]
    for name in written:
        events = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert [e["plan_id"] for e in events if e["event"] == "plan"] == list(range(3))


def test_readiness_is_every_wanted_replica_running_downscaling_included(monkeypatch):
    """/health's readiness (docs/serving.md): 503 until every replica the deployment wants is running. A deployment
    scaling down has them all (and some it no longer wants, stopping): it serves at full strength, so it is ready."""
    from types import SimpleNamespace

    from looped_spec.server import replicas

    def status_of(deployment_status: str, running: int):
        deployment = SimpleNamespace(status=deployment_status, replica_states={"RUNNING": running})
        app = SimpleNamespace(deployments={DEPLOYMENT_NAME: deployment})
        return lambda: SimpleNamespace(applications={replicas.APP_NAME: app})

    def readiness(deployment_status: str, running: int) -> str | None:
        monkeypatch.setattr(replicas.serve, "status", status_of(deployment_status, running))
        return asyncio.run(replicas.deployment_readiness(replicas.APP_NAME, DEPLOYMENT_NAME))

    assert readiness("HEALTHY", 2) is None
    assert readiness("DOWNSCALING", 3) is None
    assert readiness("UPSCALING", 2) == "deployment upscaling (2 replicas running)"
    assert readiness("UNHEALTHY", 1) == "deployment unhealthy (1 replicas running)"
    assert readiness("UPDATING", 0) == "deployment updating (0 replicas running)"
    monkeypatch.setattr(replicas.serve, "status", status_of("HEALTHY", 2))
    assert asyncio.run(replicas.deployment_readiness("other-app", DEPLOYMENT_NAME)) == (
        f"deployment other-app/{DEPLOYMENT_NAME} not found"
    )


def test_replicas_draw_different_seeds_for_requests_without_one():
    """A request without a seed draws one from its engine's seed. Every replica has the same engine options, so with
    one engine seed each would draw the same seeds in the same order: the first sampled request on each replica the
    same text, as if sampled once. A replica's engine seed is the deployment's plus its rank."""
    from looped_spec.server.replicas import replica_engine_options

    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)  # no seed: the engine draws one
    texts = []
    for rank in range(2):
        with LoopedSpecEngine(
            "tiny-ouro", speculation="off", **replica_engine_options({"seed": 5}, f"r{rank}", rank)
        ) as replica:
            texts.append([out.text for out in replica.generate(PROMPTS[:3], params)])
    assert texts[0] != texts[1]
    with LoopedSpecEngine("tiny-ouro", speculation="off", **replica_engine_options({"seed": 5}, "r0b", 0)) as again:
        assert [out.text for out in again.generate(PROMPTS[:3], params)] == texts[0]  # a rank's draws: reproducible


def test_replica_metrics_ports_that_take_the_proxys_port_are_refused_before_ray_starts(monkeypatch, capsys):
    """Replica r serves /metrics on --metrics-port + r, beside Ray's proxy on --port: a range holding --port would fail
    that replica at every start (its port taken by the proxy), retried by Ray until the deployment fails."""
    from looped_spec.cli import main

    started = []
    monkeypatch.setattr("looped_spec.server.replicas.run_replicas", lambda args, host, port: started.append(port))
    for flags in (["--replicas", "2", "--port", "8001"], ["--max-replicas", "3", "--port", "8002"],
                  ["--replicas", "1", "--port", "8000"]):  # fmt: skip
        assert main(["serve", "tiny-ouro", *flags, "--metrics-port", "8000"]) == 2
        err = capsys.readouterr().err
        assert "--metrics-port 8000" in err and f"--port {flags[-1]}" in err and err.count("\n") == 1, err
    assert not started
    assert main(["serve", "tiny-ouro", "--replicas", "2", "--port", "8002", "--metrics-port", "8000"]) == 0
    assert started == [8002]


def test_a_misspelt_adapter_option_is_refused_before_ray_starts(monkeypatch, capsys):
    """Each replica loads the model and its adapter refuses an option it does not take: Ray would retry it, then end in
    a traceback. The driver names the --adapter-option flag and the option meant, before any cluster starts."""
    from looped_spec.cli import main

    started = []
    monkeypatch.setattr("looped_spec.server.replicas.run_replicas", lambda args, host, port: started.append(port))
    assert main(["serve", "tiny-huginn", "--replicas", "2", "--adapter-option", "num_step=4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "looped-spec: error: --adapter-option num_step: not an option of huginn_raven (did you mean 'num_steps'?); it "
        "takes: initial_state, num_steps, exit_criterion, exit_threshold"
    )
    assert not started
    assert main(["serve", "tiny-huginn", "--replicas", "2", "--adapter-option", "num_steps=4"]) == 0
    assert started and started[0] == 8000


def _fake_ray(monkeypatch, address, serve_running_on=None):
    """Ray and Serve as calls recorded in a list: `address` as RAY_ADDRESS, `serve_running_on` the (host, port) of a
    Serve already running on the cluster (None: none runs)."""
    from types import SimpleNamespace

    from looped_spec.server import replicas

    calls = []
    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)

    def interrupted():
        raise KeyboardInterrupt

    running = None
    if serve_running_on is not None:
        host, port = serve_running_on
        running = SimpleNamespace(http_config=SimpleNamespace(host=host, port=port))
    monkeypatch.setattr(replicas.serve.context, "_get_global_client", lambda **kwargs: running)
    monkeypatch.setattr(replicas.ray, "init", lambda **kwargs: calls.append(("ray.init", kwargs["address"])))
    monkeypatch.setattr(replicas.ray, "shutdown", lambda: calls.append(("ray.shutdown",)))
    monkeypatch.setattr(replicas.serve, "start", lambda **kwargs: calls.append(("serve.start",)))
    monkeypatch.setattr(replicas.serve, "run", lambda app, **kwargs: calls.append(("serve.run", kwargs["name"])))
    monkeypatch.setattr(replicas.serve, "delete", lambda name, **kwargs: calls.append(("serve.delete", name)))
    monkeypatch.setattr(replicas.serve, "shutdown", lambda: calls.append(("serve.shutdown",)))
    monkeypatch.setattr(replicas.signal, "signal", lambda *args: None)
    monkeypatch.setattr(replicas.signal, "pause", interrupted)
    return calls


@pytest.mark.parametrize(
    "address, serve_running",
    [(None, False), ("ray://head:10001", False), ("ray://head:10001", True), (None, True)],
)
def test_interrupting_the_cli_removes_only_its_own_application_from_a_cluster_it_joined(
    monkeypatch, address, serve_running
):
    """Ctrl-C / SIGTERM ends `looped-spec serve --replicas`. A local cluster it started goes whole (Serve and Ray shut
    down); on a cluster it joined (RAY_ADDRESS, or one found on this machine whose Serve already runs) Serve may run
    other applications: only looped-spec's is deleted."""
    from looped_spec.server import replicas

    calls = _fake_ray(monkeypatch, address, ("127.0.0.1", 8000) if serve_running else None)
    replicas.run_replicas(parse_args({"model": "tiny-ouro"}), "127.0.0.1", 8000)
    ends = [call for call in calls if call[0] in ("serve.delete", "serve.shutdown", "ray.shutdown")]
    if address is None and not serve_running:
        assert ends == [("serve.shutdown",), ("ray.shutdown",)]
    else:
        assert ends == [("serve.delete", replicas.APP_NAME), ("ray.shutdown",)]  # the driver disconnects
    assert calls[0] == ("ray.init", address)
    assert ("serve.run", replicas.APP_NAME) in calls


@pytest.mark.parametrize("address", [None, "ray://head:10001"])
def test_a_cluster_whose_serve_listens_elsewhere_is_refused_naming_the_flags(monkeypatch, capsys, address):
    """Serve's HTTP host and port are the cluster's: where Serve already runs elsewhere, Ray would keep its address and
    only log that --host / --port were ignored, and the CLI would announce an address nothing listens on. It refuses,
    naming both addresses, and deploys nothing (so deletes nothing, and leaves that Serve running)."""
    from looped_spec.cli import main

    calls = _fake_ray(monkeypatch, address, ("0.0.0.0", 8000))
    assert main(["serve", "tiny-ouro", "--replicas", "2", "--host", "127.0.0.1", "--port", "8001"]) == 2
    err = capsys.readouterr().err
    assert "--host 127.0.0.1 --port 8001" in err and "0.0.0.0:8000" in err and "--host 0.0.0.0 --port 8000" in err, err
    assert [call[0] for call in calls] == ["ray.init", "ray.shutdown"]
