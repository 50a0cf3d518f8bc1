//! Work assignment: `agents/<agent_id>` with `available`, `max_tasks` and `tasks`, and
//! `assignments/<task_id>`.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, nothing_to_undo, unknown_tool,
};

pub struct Agents;

impl Plugin for Agents {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            ToolSpec::action(
                "assign",
                "Assigns a task to an agent; refused when the agent is unavailable or full.",
                json!({
                    "type": "object",
                    "properties": {
                        "agent_id": { "type": "string" },
                        "task_id": { "type": "string" },
                        "after": { "type": "string" }
                    },
                    "required": ["agent_id", "task_id"]
                }),
                "unassign",
            ),
            ToolSpec::undo(
                "unassign",
                "Takes a task away from the agent it was assigned to.",
                compensator_schema("task_id"),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, _ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "assign" => assign(store, args),
            "unassign" => unassign(store, args),
            other => Err(unknown_tool(other)),
        }
    }
}

fn assign(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let a = Args(args);
    let (agent_id, task_id) = (a.str("agent_id")?, a.str("task_id")?);
    if let Some(existing) = store.doc("assignments", task_id)? {
        if existing["agent_id"] == agent_id {
            return Ok(existing);
        }
        return Err(ToolError::Rejected(format!("task {task_id} is already assigned to {}", existing["agent_id"])));
    }
    let mut agent = store.existing("agents", agent_id, "agent")?;
    if agent["available"] != true {
        return Err(ToolError::Rejected(format!("agent {agent_id} is unavailable")));
    }
    let max = agent["max_tasks"].as_u64().unwrap_or(u64::MAX);
    let tasks = agent["tasks"]
        .as_array_mut()
        .ok_or_else(|| ToolError::Transient(format!("agent {agent_id} has no task list")))?;
    if tasks.len() as u64 >= max {
        return Err(ToolError::Rejected(format!("agent {agent_id} already has {max} tasks")));
    }
    tasks.push(json!(task_id));
    let assignment = json!({
        "task_id": task_id,
        "agent_id": agent_id,
        "after": a.opt_str("after"),
        "confirmationNumber": format!("{agent_id}/{task_id}"),
    });
    store.put_doc("agents", agent_id, &agent)?;
    store.put_doc("assignments", task_id, &assignment)?;
    Ok(assignment)
}

fn unassign(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    // The task id is the assignment's key, so the forward arguments name it even when the
    // forward reply was lost.
    let task_id = ["/task_id", "/forward/arguments/task_id", "/forward/output/task_id"]
        .iter()
        .find_map(|p| args.pointer(p).and_then(Value::as_str))
        .ok_or_else(|| ToolError::InvalidInput("need 'task_id' or the forward call it undoes".into()))?
        .to_string();
    let Some(assignment) = store.doc("assignments", &task_id)? else {
        return Ok(nothing_to_undo(&task_id));
    };
    let agent_id = assignment["agent_id"].as_str().unwrap_or_default();
    if let Some(mut agent) = store.doc("agents", agent_id)?
        && let Some(tasks) = agent["tasks"].as_array_mut()
    {
        tasks.retain(|t| t != task_id.as_str());
        store.put_doc("agents", agent_id, &agent)?;
    }
    store.delete("assignments", &task_id)?;
    Ok(json!({ "undone": true, "id": task_id }))
}
