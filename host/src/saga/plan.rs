//! Validation: a saga definition checked against the loaded plugins and turned into a
//! [`Plan`] the engine can run without further checks.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::binding::{self, BindingPath, Root};
use super::definition::{RetryPolicy, SagaDef, StepDef};
use crate::runtime::{LimitOverrides, Runtime};

/// A compensator as the plan runs it.
#[derive(Clone, Debug)]
pub struct CompensatorPlan {
    /// `<plugin>.<tool>`.
    pub tool: String,
    /// Template; `$.steps.<own id>` is the forward step's output.
    pub arguments: Value,
}

/// A validated step.
#[derive(Clone, Debug)]
pub struct PlannedStep {
    pub id: String,
    pub name: Option<String>,
    /// `<plugin>.<tool>`.
    pub tool: String,
    pub arguments: Value,
    pub input: Option<Value>,
    pub side_effects: bool,
    pub compensator: Option<CompensatorPlan>,
    /// Indices of the steps this one needs.
    pub deps: Vec<usize>,
    /// Indices of every step that must complete before this one (transitive deps).
    pub ancestors: BTreeSet<usize>,
    pub retry: RetryPolicy,
    pub timeout: Option<Duration>,
    pub limits: LimitOverrides,
}

/// A validated saga.
#[derive(Clone, Debug)]
pub struct Plan {
    pub steps: Vec<PlannedStep>,
    pub timeout: Option<Duration>,
    pub output: Option<Value>,
    pub ledgers: Vec<String>,
    pub compensation_retry: RetryPolicy,
}

impl Plan {
    pub fn step(&self, id: &str) -> Option<(usize, &PlannedStep)> {
        self.steps.iter().enumerate().find(|(_, s)| s.id == id)
    }

    /// Indices of the steps that depend on `index` directly.
    pub fn dependants(&self, index: usize) -> impl Iterator<Item = usize> + '_ {
        self.steps.iter().enumerate().filter(move |(_, s)| s.deps.contains(&index)).map(|(i, _)| i)
    }
}

/// One problem with a saga, naming the file and, where it has one, the step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    pub step: Option<String>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.step {
            Some(step) => write!(f, "{}: step '{step}': {}", self.file.display(), self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

/// Every problem found in a saga.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
pub struct Problems(pub Vec<Problem>);

/// Merges a step's resolved input over its action's arguments.
pub fn merge_args(arguments: Value, input: Option<Value>) -> Result<Value, String> {
    match (arguments, input) {
        (arguments, None) => Ok(arguments),
        (Value::Object(mut base), Some(Value::Object(extra))) => {
            base.extend(extra);
            Ok(Value::Object(base))
        }
        (Value::Object(base), Some(input)) if base.is_empty() => Ok(input),
        (_, Some(input)) => {
            Err(format!("the input is {input}, not an object, so it cannot be merged with the action's arguments"))
        }
    }
}

/// Checks `def` (read from `file`) against the loaded plugins.
pub fn plan(def: &SagaDef, file: &Path, runtime: &Runtime) -> Result<Plan, Problems> {
    let mut problems = Vec::new();
    let mut problem = |step: Option<&str>, message: String| {
        problems.push(Problem { file: file.to_path_buf(), step: step.map(str::to_string), message })
    };
    if def.steps.is_empty() {
        problem(None, "the saga has no steps".into());
    }
    let mut index = BTreeMap::new();
    for (i, step) in def.steps.iter().enumerate() {
        if step.id.is_empty() {
            problem(None, format!("step #{} has an empty id", i + 1));
        } else if index.insert(step.id.clone(), i).is_some() {
            problem(Some(&step.id), "the step id is used twice".into());
        }
    }

    let dag = def.steps.iter().any(|s| s.depends_on.is_some());
    let mut deps: Vec<Vec<usize>> = Vec::new();
    for (i, step) in def.steps.iter().enumerate() {
        let mut mine = Vec::new();
        if dag {
            for dep in step.depends_on.iter().flatten() {
                match index.get(dep) {
                    Some(&j) if j == i => problem(Some(&step.id), "it depends on itself".into()),
                    Some(&j) => mine.push(j),
                    None => problem(Some(&step.id), format!("depends_on names the unknown step '{dep}'")),
                }
            }
        } else if i > 0 {
            mine.push(i - 1);
        }
        deps.push(mine);
    }
    let ancestors = match ancestors(&deps) {
        Ok(a) => a,
        Err(cycle) => {
            let names: Vec<&str> = cycle.iter().map(|&i| def.steps[i].id.as_str()).collect();
            problem(None, format!("the dependencies form a cycle: {}", names.join(" -> ")));
            vec![BTreeSet::new(); def.steps.len()]
        }
    };

    let mut steps = Vec::new();
    for (i, step) in def.steps.iter().enumerate() {
        match plan_step(step, runtime, &index, &ancestors[i], i) {
            Ok(mut planned) => {
                planned.deps = deps[i].clone();
                planned.ancestors = ancestors[i].clone();
                steps.push(planned);
            }
            Err(messages) => messages.into_iter().for_each(|m| problem(Some(&step.id), m)),
        }
    }
    if let Some(output) = &def.output {
        for reference in binding::references(output) {
            match reference {
                Ok(BindingPath { root: Root::Step(id), text, .. }) if !index.contains_key(&id) => {
                    problem(None, format!("output binding {text} names the unknown step '{id}'"))
                }
                Ok(_) => {}
                Err(e) => problem(None, format!("output: {e}")),
            }
        }
    }
    for (name, policy) in def.steps.iter().filter_map(|s| s.retry.as_ref().map(|r| (&s.id, r))) {
        if let Err(m) = check_retry(policy) {
            problem(Some(name), m);
        }
    }
    if let Some(Err(m)) = def.compensation_retry.as_ref().map(check_retry) {
        problem(None, format!("compensation_retry: {m}"));
    }
    if !problems.is_empty() {
        return Err(Problems(problems));
    }
    Ok(Plan {
        steps,
        timeout: def.timeout.map(|t| t.0),
        output: def.output.clone(),
        ledgers: def.ledgers.clone(),
        compensation_retry: def.compensation_retry.clone().unwrap_or_else(RetryPolicy::compensation),
    })
}

fn check_retry(policy: &RetryPolicy) -> Result<(), String> {
    if policy.max_attempts == 0 || policy.max_attempts > 100 {
        return Err(format!("retry.max_attempts must be between 1 and 100, not {}", policy.max_attempts));
    }
    if !(policy.multiplier >= 1.0 && policy.multiplier <= 100.0) {
        return Err(format!("retry.multiplier must be between 1 and 100, not {}", policy.multiplier));
    }
    if !(0.0..=1.0).contains(&policy.jitter) {
        return Err(format!("retry.jitter must be between 0 and 1, not {}", policy.jitter));
    }
    Ok(())
}

/// The transitive dependencies of every step, or a cycle.
fn ancestors(deps: &[Vec<usize>]) -> Result<Vec<BTreeSet<usize>>, Vec<usize>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Visiting,
        Done,
    }
    fn visit(
        i: usize,
        deps: &[Vec<usize>],
        marks: &mut [Mark],
        out: &mut [BTreeSet<usize>],
        path: &mut Vec<usize>,
    ) -> Result<(), Vec<usize>> {
        match marks[i] {
            Mark::Done => return Ok(()),
            Mark::Visiting => {
                let start = path.iter().position(|&p| p == i).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(i);
                return Err(cycle);
            }
            Mark::New => {}
        }
        marks[i] = Mark::Visiting;
        path.push(i);
        let mut mine = BTreeSet::new();
        for &d in &deps[i] {
            visit(d, deps, marks, out, path)?;
            mine.insert(d);
            mine.extend(out[d].iter().copied());
        }
        path.pop();
        out[i] = mine;
        marks[i] = Mark::Done;
        Ok(())
    }
    let mut marks = vec![Mark::New; deps.len()];
    let mut out = vec![BTreeSet::new(); deps.len()];
    for i in 0..deps.len() {
        visit(i, deps, &mut marks, &mut out, &mut Vec::new())?;
    }
    Ok(out)
}

/// Checks one step's tools, bindings and static arguments.
fn plan_step(
    step: &StepDef,
    runtime: &Runtime,
    index: &BTreeMap<String, usize>,
    ancestors: &BTreeSet<usize>,
    own: usize,
) -> Result<PlannedStep, Vec<String>> {
    let mut messages = Vec::new();
    let check_bindings = |template: &Value, what: &str, allow_self: bool, messages: &mut Vec<String>| {
        for reference in binding::references(template) {
            match reference {
                Err(e) => messages.push(format!("{what}: {e}")),
                Ok(BindingPath { root: Root::Step(id), text, .. }) => match index.get(&id) {
                    None => messages.push(format!("{what}: {text} names the unknown step '{id}'")),
                    Some(&j) if j == own && allow_self => {}
                    Some(&j) if !ancestors.contains(&j) => messages.push(format!(
                        "{what}: {text} reads step '{id}', which is not guaranteed to run before this one \
                         (list it in depends_on)"
                    )),
                    Some(_) => {}
                },
                Ok(_) => {}
            }
        }
    };
    check_bindings(&step.action.arguments, "action.arguments", false, &mut messages);
    if let Some(input) = &step.input {
        check_bindings(input, "input", false, &mut messages);
    }
    if let Some(compensate) = &step.compensate {
        check_bindings(&compensate.arguments, "compensate.arguments", true, &mut messages);
    }
    if !step.action.arguments.is_object() {
        messages.push("action.arguments must be an object".into());
    }

    let (side_effects, declared_compensator, static_check) = match runtime.resolve(&step.action.name) {
        Ok((plugin, tool)) => {
            (tool.info.side_effects, tool.info.compensator.as_ref().map(|c| format!("{}.{c}", plugin.name)), Some(tool))
        }
        Err(e) => {
            messages.push(format!("action: {e}"));
            (false, None, None)
        }
    };
    let static_args = binding::references(&step.action.arguments).is_empty()
        && step.input.as_ref().is_none_or(|i| binding::references(i).is_empty());
    if let (Some(tool), true) = (static_check, static_args) {
        match merge_args(step.action.arguments.clone(), step.input.clone()) {
            Ok(args) => {
                if let Some(errors) = tool.schema_errors(&args) {
                    messages.push(format!("the arguments do not match {}'s schema: {errors}", step.action.name));
                }
            }
            Err(e) => messages.push(e),
        }
    }
    let compensator = match &step.compensate {
        Some(explicit) => {
            if let Err(e) = runtime.resolve(&explicit.name) {
                messages.push(format!("compensate: {e}"));
            }
            Some(CompensatorPlan { tool: explicit.name.clone(), arguments: explicit.arguments.clone() })
        }
        None => declared_compensator.map(|tool| CompensatorPlan { tool, arguments: Value::Object(Default::default()) }),
    };
    if side_effects && compensator.is_none() && !step.no_compensation {
        messages.push(format!(
            "{} has side effects and no compensator: add `compensate`, or `\"no_compensation\": true` \
             if the effect may stay when the saga fails",
            step.action.name
        ));
    }
    let limits = step.limits.clone().unwrap_or_default();
    if let Ok((plugin, _)) = runtime.resolve(&step.action.name)
        && let Err(e) = runtime.limits_for(plugin, &limits).check()
    {
        messages.push(format!("limits: {e}"));
    }
    if !messages.is_empty() {
        return Err(messages);
    }
    Ok(PlannedStep {
        id: step.id.clone(),
        name: step.name.clone(),
        tool: step.action.name.clone(),
        arguments: step.action.arguments.clone(),
        input: step.input.clone(),
        side_effects,
        compensator: if step.no_compensation && step.compensate.is_none() { None } else { compensator },
        deps: Vec::new(),
        ancestors: BTreeSet::new(),
        retry: step.retry.clone().unwrap_or_default(),
        timeout: step.timeout.map(|t| t.0),
        limits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merging_input_over_arguments() {
        assert_eq!(merge_args(json!({"a": 1, "b": 1}), Some(json!({"b": 2}))).unwrap(), json!({"a": 1, "b": 2}));
        assert_eq!(merge_args(json!({}), Some(json!([1]))).unwrap(), json!([1]));
        assert!(merge_args(json!({"a": 1}), Some(json!(5))).is_err());
        assert_eq!(merge_args(json!({"a": 1}), None).unwrap(), json!({"a": 1}));
    }

    #[test]
    fn ancestors_are_transitive_and_cycles_are_found() {
        let chain = ancestors(&[vec![], vec![0], vec![1], vec![0]]).unwrap();
        assert_eq!(chain[2], BTreeSet::from([0, 1]));
        assert_eq!(chain[3], BTreeSet::from([0]));
        let cycle = ancestors(&[vec![2], vec![0], vec![1]]).unwrap_err();
        assert_eq!(cycle.first(), cycle.last());
        assert_eq!(cycle.len(), 4);
    }
}
