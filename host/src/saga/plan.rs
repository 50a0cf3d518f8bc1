//! Validation: a saga definition checked against the loaded plugins and turned into a
//! [`Plan`] the engine can run without further checks.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::binding::{self, BindingPath, Root};
use super::definition::{RetryPolicy, SagaDef, StepDef};
use crate::runtime::policy::MAX_DEADLINE_MS;
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
    pub retry: RetryPolicy,
    pub timeout: Option<Duration>,
    pub limits: LimitOverrides,
    pub key: StepKey,
}

/// A step's idempotency key: what its plugin sees and its journal records, and, through
/// [`crate::ids::cache_key`], where its result is cached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StepKey {
    /// Derived when the step runs, from the run, the step and its bound arguments.
    #[default]
    Derived,
    /// Fixed in advance from the run (a session's call): cached under the run.
    OfRun(String),
    /// Named by a client: cached as it is, since a retry with it may come in another run.
    ClientNamed(String),
}

impl StepKey {
    /// The key, when fixed before the step runs.
    pub fn fixed(&self) -> Option<&str> {
        match self {
            StepKey::Derived => None,
            StepKey::OfRun(key) | StepKey::ClientNamed(key) => Some(key),
        }
    }

    pub fn is_client_named(&self) -> bool {
        matches!(self, StepKey::ClientNamed(_))
    }
}

/// A validated saga.
#[derive(Clone, Debug)]
pub struct Plan {
    pub steps: Vec<PlannedStep>,
    pub timeout: Option<Duration>,
    pub output: Option<Value>,
    pub ledgers: Vec<String>,
    pub compensation_retry: RetryPolicy,
    /// Step index by id.
    index: HashMap<String, usize>,
    /// The steps that depend directly on each step.
    dependants: Vec<Vec<usize>>,
}

impl Plan {
    /// The plan of a session: no steps yet (they arrive one call at a time), a time-out, and
    /// the default compensation retries.
    pub fn for_session(timeout: Option<Duration>) -> Plan {
        Plan {
            steps: Vec::new(),
            timeout,
            output: None,
            ledgers: Vec::new(),
            compensation_retry: RetryPolicy::compensation(),
            index: HashMap::new(),
            dependants: Vec::new(),
        }
    }

    pub fn step(&self, id: &str) -> Option<(usize, &PlannedStep)> {
        self.index.get(id).map(|&i| (i, &self.steps[i]))
    }

    /// Indices of the steps that depend on `index` directly.
    pub fn dependants(&self, index: usize) -> &[usize] {
        &self.dependants[index]
    }

    /// Whether two steps may run at once (forward or compensating): the steps do not form
    /// a single chain.
    pub fn has_branches(&self) -> bool {
        self.steps.iter().enumerate().any(|(i, s)| s.deps.len() > 1 || self.dependants[i].len() > 1)
            || self.steps.iter().filter(|s| s.deps.is_empty()).count() > 1
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
    let mut index = HashMap::with_capacity(def.steps.len());
    for (i, step) in def.steps.iter().enumerate() {
        if step.id.is_empty() {
            problem(None, format!("step #{} has an empty id", i + 1));
        } else if index.insert(step.id.clone(), i).is_some() {
            problem(Some(&step.id), "the step id is used twice".into());
        }
    }

    let dag = def.steps.iter().any(|s| s.depends_on.is_some());
    let mut deps: Vec<Vec<usize>> = Vec::with_capacity(def.steps.len());
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
            mine.sort_unstable();
            mine.dedup();
        } else if i > 0 {
            mine.push(i - 1);
        }
        deps.push(mine);
    }
    let ancestry = match Ancestry::new(&deps, dag) {
        Ok(ancestry) => ancestry,
        Err(cycle) => {
            let names: Vec<&str> = cycle.iter().map(|&i| def.steps[i].id.as_str()).collect();
            problem(None, format!("the dependencies form a cycle: {}", names.join(" -> ")));
            Ancestry::Unknown
        }
    };

    let mut steps = Vec::with_capacity(def.steps.len());
    for (i, step) in def.steps.iter().enumerate() {
        match plan_step(step, runtime, &index, &ancestry, i) {
            Ok(mut planned) => {
                planned.deps = deps[i].clone();
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
    let mut dependants = vec![Vec::new(); steps.len()];
    for (i, step) in steps.iter().enumerate() {
        for &d in &step.deps {
            dependants[d].push(i);
        }
    }
    Ok(Plan {
        steps,
        timeout: def.timeout.map(|t| t.0),
        output: def.output.clone(),
        ledgers: def.ledgers.clone(),
        compensation_retry: def.compensation_retry.clone().unwrap_or_else(RetryPolicy::compensation),
        index,
        dependants,
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

/// Answers "must step `j` complete before step `i`?" without building every step's set of
/// ancestors (quadratic in a long chain).
enum Ancestry {
    /// No `depends_on`: steps run in file order, so every earlier step is an ancestor.
    Sequential,
    /// A DAG: each step's ancestors as a bit set, built lazily on the first question that
    /// its direct dependencies do not answer.
    Dag { deps: Vec<Vec<usize>>, order: Vec<usize>, bits: std::cell::OnceCell<Vec<Vec<u64>>> },
    /// The dependencies have a cycle (already reported): answer yes, to avoid follow-up noise.
    Unknown,
}

impl Ancestry {
    /// The ancestry of `deps`, or a cycle (its first step repeated at the end).
    fn new(deps: &[Vec<usize>], dag: bool) -> Result<Ancestry, Vec<usize>> {
        if !dag {
            return Ok(Ancestry::Sequential);
        }
        let order = topological_order(deps)?;
        Ok(Ancestry::Dag { deps: deps.to_vec(), order, bits: std::cell::OnceCell::new() })
    }

    fn is_ancestor(&self, j: usize, of: usize) -> bool {
        match self {
            Ancestry::Sequential => j < of,
            Ancestry::Unknown => true,
            Ancestry::Dag { deps, order, bits } => {
                if deps[of].contains(&j) {
                    return true;
                }
                let bits = bits.get_or_init(|| ancestor_bits(deps, order));
                bits[of].get(j / 64).is_some_and(|w| w & (1 << (j % 64)) != 0)
            }
        }
    }
}

/// The steps in an order where each comes after its dependencies (Kahn), or a cycle.
fn topological_order(deps: &[Vec<usize>]) -> Result<Vec<usize>, Vec<usize>> {
    let n = deps.len();
    let mut waiting: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut dependants = vec![Vec::new(); n];
    for (i, mine) in deps.iter().enumerate() {
        for &d in mine {
            dependants[d].push(i);
        }
    }
    let mut order: Vec<usize> = (0..n).filter(|&i| waiting[i] == 0).collect();
    let mut next = 0;
    while next < order.len() {
        let i = order[next];
        next += 1;
        for &j in &dependants[i] {
            waiting[j] -= 1;
            if waiting[j] == 0 {
                order.push(j);
            }
        }
    }
    if order.len() == n {
        return Ok(order);
    }
    // Every step left waits on another one left: walk back from any until a step repeats.
    let start = (0..n).find(|&i| waiting[i] > 0).unwrap_or(0);
    let mut path = vec![start];
    let mut seen = vec![usize::MAX; n];
    seen[start] = 0;
    let mut at = start;
    loop {
        let Some(&prev) = deps[at].iter().find(|&&d| waiting[d] > 0) else { return Err(path) };
        if seen[prev] != usize::MAX {
            let mut cycle = path[seen[prev]..].to_vec();
            cycle.push(prev);
            return Err(cycle);
        }
        seen[prev] = path.len();
        path.push(prev);
        at = prev;
    }
}

/// Every step's ancestors as a bit set, in topological order.
fn ancestor_bits(deps: &[Vec<usize>], order: &[usize]) -> Vec<Vec<u64>> {
    let words = deps.len().div_ceil(64);
    let mut bits = vec![Vec::new(); deps.len()];
    for &i in order {
        let mut mine = vec![0u64; words];
        for &d in &deps[i] {
            mine[d / 64] |= 1 << (d % 64);
            for (w, dw) in mine.iter_mut().zip(&bits[d]) {
                *w |= dw;
            }
        }
        bits[i] = mine;
    }
    bits
}

/// Checks one step's tools, bindings and static arguments.
fn plan_step(
    step: &StepDef,
    runtime: &Runtime,
    index: &HashMap<String, usize>,
    ancestry: &Ancestry,
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
                    Some(&j) if !ancestry.is_ancestor(j, own) => messages.push(format!(
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
    if let Some(timeout) = step.timeout
        && timeout.0 > std::time::Duration::from_millis(MAX_DEADLINE_MS)
    {
        messages.push(format!("timeout {} is longer than the 24 h a call may run", timeout));
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
        retry: step.retry.clone().unwrap_or_default(),
        timeout: step.timeout.map(|t| t.0),
        limits,
        key: StepKey::Derived,
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
        let dag = Ancestry::new(&[vec![], vec![0], vec![1], vec![0]], true).unwrap();
        assert!(dag.is_ancestor(0, 2) && dag.is_ancestor(1, 2));
        assert!(dag.is_ancestor(0, 3) && !dag.is_ancestor(1, 3) && !dag.is_ancestor(2, 3));
        assert!(!dag.is_ancestor(2, 1));
        let cycle = Ancestry::new(&[vec![2], vec![0], vec![1]], true).err().unwrap();
        assert_eq!(cycle.first(), cycle.last());
        assert_eq!(cycle.len(), 4);
        // A cycle hanging off an acyclic part is still found.
        let tail = Ancestry::new(&[vec![], vec![0, 3], vec![1], vec![2]], true).err().unwrap();
        assert_eq!(tail.first(), tail.last());
        assert_eq!(tail.len(), 4);
        let sequential = Ancestry::new(&[vec![], vec![0], vec![1]], false).unwrap();
        assert!(sequential.is_ancestor(0, 2) && !sequential.is_ancestor(2, 0));
    }

    #[test]
    fn ancestry_of_a_wide_dag_crosses_word_boundaries() {
        // 0 <- 1 <- ... <- 199, plus 200 depending on 0 only.
        let mut deps: Vec<Vec<usize>> = (0..200).map(|i| if i == 0 { vec![] } else { vec![i - 1] }).collect();
        deps.push(vec![0]);
        let dag = Ancestry::new(&deps, true).unwrap();
        assert!(dag.is_ancestor(63, 199) && dag.is_ancestor(64, 199) && dag.is_ancestor(0, 199));
        assert!(!dag.is_ancestor(64, 200) && dag.is_ancestor(0, 200));
    }
}
