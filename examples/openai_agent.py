"""An agent that owns its loop, written with the `openai` package, solving a task through
`belayer serve`: Belayer keeps its session durable while the agent just calls an endpoint.

    .venv/bin/belayer up          # starts the endpoint too, on http://127.0.0.1:8400/v1
    .venv/bin/python examples/openai_agent.py [--workload examples/workloads/agent.yaml]
        [--task hello-file] [--crash-engine-at-call 1] [--json]

The task is read from the workload here and sent with the session's start; a task the
endpoint serves itself (`belayer serve --workload PATH`) may be named by its id instead.

The loop is the agent's: ask the model (POST /v1/chat/completions, the session in the
X-Session-ID header), run the `<bash>` command it wrote in the session's sandbox (POST
/v1/sessions/ID/exec), send the output back as a tool message, stop when the model stops;
then POST /v1/sessions/ID/finish runs the task's check. Each call carries an X-Request-ID,
so the openai client's own retries can never generate a turn twice.

`--crash-engine-at-call K` kills the rollout node's leader engine while the agent's K-th
model call is being answered (the chaos tool `belayer chaos` uses): the call returns, a
little later, with the tokens it would have had; the agent never sees an error.
The agent decides its next action with `belayer.workloads.drivers.policy_action`, the
parser `belayer run` uses, so a session gives exactly the tokens `belayer run` gives for
the same task and seed (tests/workflows/test_agent_endpoint.py checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from belayer.chaos.faults import Chaos
from belayer.config import load_config
from belayer.workloads.drivers import policy_action
from belayer.workloads.loader import load_workload

CRASH_DELAY_S = 0.3  # into the call: past the endpoint and Temporal, the engine decoding by then


async def run_agent(base_url: str, task: str | dict, *, seed: int = 0, temperature: float = 1.0,
                    crash_at_call: int | None = None, crash=None) -> dict:  # fmt: skip
    """One session of `task` (an id the endpoint serves, or the task itself) driven to its
    end; its finish answer, and `crash` (a callable that kills the engine) run during model
    call `crash_at_call` (1 is the first)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        started = _ok(
            await http.post("/sessions", json={"task": task, "seed": seed, "temperature": temperature})
        )
        session = started["session_id"]
        model = AsyncOpenAI(base_url=base_url, api_key="unused", default_headers={"X-Session-ID": session})
        messages = [{"role": "user", "content": started["instruction"]}]
        crash_landed, recovered = None, []
        for call in range(1, started["turn_limit"] + 1):
            asking = asyncio.ensure_future(
                model.chat.completions.create(
                    model="belayer",
                    messages=messages,
                    max_tokens=started["max_tokens_per_turn"],
                    extra_headers={"X-Request-ID": f"{session}-call-{call}"},
                )
            )
            if call == crash_at_call and crash is not None:
                await asyncio.sleep(CRASH_DELAY_S)
                crash_landed = "between calls" if asking.done() else "mid-call"
                await asyncio.to_thread(crash)
            reply = await asking
            recoveries = (reply.model_extra or {}).get("belayer", {}).get("engine_recoveries", [])
            if call == crash_at_call and crash_landed == "mid-call" and not recoveries:
                crash_landed = "mid-call, before its generation began (the node had recovered by then)"
            recovered += recoveries
            text = reply.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            command = policy_action(text)
            if command is None:
                break
            observation = _ok(await http.post(f"/sessions/{session}/exec", json={"command": command}))
            messages.append({"role": "tool", "content": observation["output"]})
            print(
                f"step {observation['step']}: {command!r} -> exit {observation['exit_code']}", file=sys.stderr
            )
        finished = _ok(await http.post(f"/sessions/{session}/finish"))
        return finished | {"crash_landed": crash_landed, "engine_recoveries": recovered}


def _ok(response: httpx.Response) -> dict:
    if response.status_code != 200:
        raise SystemExit(f"error: {response.request.url}: {response.json()['error']['message']}")
    return response.json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="examples/workloads/agent.yaml", help="Where the task is.")
    parser.add_argument("--task", default="hello-file", help="The task's id in the workload.")
    parser.add_argument(
        "--url", default="http://127.0.0.1:8400/v1", help="The endpoint (belayer up starts it)."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--crash-engine-at-call", type=int, metavar="K", help="Kill the engine during model call K."
    )
    parser.add_argument("--json", action="store_true", help="Print the session's end as JSON.")
    args = parser.parse_args()
    tasks = {task.id: task for task in load_workload(Path(args.workload)).tasks}
    if args.task not in tasks:
        raise SystemExit(f"error: no task {args.task!r} in {args.workload} (its tasks: {', '.join(tasks)})")
    crash = None
    if args.crash_engine_at_call:
        crash = lambda: Chaos(load_config()).inject("engine-crash")  # noqa: E731
    finished = asyncio.run(run_agent(args.url, tasks[args.task].model_dump(mode="json"), seed=args.seed,
                                     crash_at_call=args.crash_engine_at_call, crash=crash))  # fmt: skip
    if args.json:
        print(json.dumps(finished, indent=2))
    else:
        print(f"{finished['session_id']}: {finished['status']}, reward {finished['reward']}, "
              f"{finished['turns']} actions, engine crash {finished['crash_landed'] or 'not asked'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
