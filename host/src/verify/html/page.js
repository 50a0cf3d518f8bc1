"use strict";
// Draws the report embedded in #report-data. Everything from the report reaches the page
// as text nodes or attribute values, never as markup.
(() => {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const timingNode = document.getElementById("timing");
  const timing = timingNode ? JSON.parse(timingNode.textContent) : null;
  const SVG = "http://www.w3.org/2000/svg";

  function fill(node, kids) {
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return node;
  }
  function attrs(node, props) {
    for (const [name, value] of Object.entries(props || {})) {
      if (value !== null && value !== undefined && value !== false) node.setAttribute(name, String(value));
    }
    return node;
  }
  const h = (tag, props, ...kids) => fill(attrs(document.createElement(tag), props), kids);
  const s = (tag, props, ...kids) => fill(attrs(document.createElementNS(SVG, tag), props), kids);

  const percent = (x) => (x * 100).toFixed(1) + "%";
  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
  const phaseName = (p) => (p ? "compensation" : "action");

  function card(id, label, value, tone, note) {
    return h("div", { class: "card" + (tone ? " " + tone : ""), id },
      h("span", { class: "label" }, label), h("span", { class: "value" }, value),
      note ? h("span", { class: "note" }, note) : null);
  }

  function header() {
    const t = data.totals;
    const verdict = data.passed ? "PASSED: every case passed"
      : t.failed > 0 ? `FAILED: ${t.failed} of ${t.cases} cases failed`
      : "FAILED: the campaign failed (see its problems), although no case did";
    return h("header", { class: "top " + (data.passed ? "ok" : "bad") },
      h("h1", {}, "sagabox verify"),
      h("p", { class: "verdict", id: "verdict" }, verdict),
      h("p", { class: "meta" },
        `sagabox ${data.sagabox} · seed ${data.seed} · ${data.runs} random schedules per saga · faults: ${data.faults.join(", ")}`));
  }

  function summary() {
    const t = data.totals;
    const cards = h("div", { class: "cards", id: "summary" },
      card("m-sagas", "sagas", data.sagas.length),
      card("m-cases", "cases", t.cases),
      card("m-passed", "passed", t.passed, "good"),
      card("m-failed", "failed", t.failed, t.failed ? "bad" : "good"),
      card("m-rollback", "rollback success", percent(t.rollback_success_rate)),
      card("m-coverage", "compensation coverage", percent(t.compensation_coverage)),
      card("m-efficiency", "compensation efficiency", percent(t.compensation_efficiency)),
      timing ? card("m-rate", "cases/s", Math.round(timing.cases_per_second),
        null, `${timing.seconds.toFixed(2)} s, wall clock: varies`) : null);
    const row = (cells) => h("tr", {}, cells);
    const num = (n, bad) => h("td", { class: "num" + (bad && n ? " bad" : "") }, n);
    const kinds = h("table", { id: "by-kind" },
      h("caption", {}, "By fault kind"),
      h("thead", {}, row([h("th", {}, "fault kind"), h("th", {}, "cases"), h("th", {}, "passed"), h("th", {}, "failed")])),
      h("tbody", {}, data.by_kind.map((k) => row([h("td", {}, k.kind), num(k.cases), num(k.passed), num(k.failed, true)]))));
    const sagas = h("table", { id: "by-saga" },
      h("caption", {}, "By saga"),
      h("thead", {}, row(["saga", "cases", "passed", "failed", "rollback success", "coverage", "efficiency"].map((x) => h("th", {}, x)))),
      h("tbody", {}, data.sagas.map((saga, i) => {
        const m = saga.metrics;
        return row([h("td", {}, h("a", { href: `#saga-${i}` }, saga.name)), num(m.cases), num(m.passed), num(m.failed, true),
          num(percent(m.rollback_success_rate)), num(percent(m.compensation_coverage)), num(percent(m.compensation_efficiency))]);
      })));
    return [cards, h("div", { class: "tables" }, kinds, sagas), problems(data.problems, "campaign-problems")];
  }

  function problems(list, id) {
    if (!list.length) return null;
    return h("div", { id }, h("h4", {}, "Problems"), h("ul", { class: "problems" }, list.map((p) => h("li", {}, p))));
  }

  function swatch(cls, shape) {
    const svg = s("svg", { width: 22, height: 12 });
    svg.append(shape === "fault" ? s("polygon", { class: "fault", points: "5,1 17,1 11,11" })
      : shape === "line" ? s("line", { class: "rollback", x1: 11, y1: 0, x2: 11, y2: 12 })
      : s("rect", { class: cls, x: 1, y: 2, width: 20, height: 8, rx: 2 }));
    return svg;
  }

  function legend() {
    const items = [
      ["bar action completed", "action"], ["bar compensation completed", "compensation"],
      ["bar action failed", "failed"], ["bar action retried", "retried (transient)"],
      ["bar action lost", "reply lost"], ["bar action repeat", "delivered again"],
    ];
    return h("div", { class: "legend", id: "legend" },
      items.map(([cls, label]) => h("span", {}, swatch(cls), label)),
      h("span", {}, swatch("", "fault"), "injected fault"),
      h("span", {}, swatch("", "line"), "rollback starts"),
      h("span", {}, "time runs left to right in journal order (logical, not wall clock)"));
  }

  // A case's run: a lane per step, a bar per attempt, placed by journal order.
  function timeline(steps, tl, compact) {
    const lane = compact ? 7 : 22, barH = compact ? 5 : 12, top = compact ? 1 : 16;
    const left = compact ? 0 : 170;
    const ticks = Math.max(tl.ticks, 1);
    const u = compact ? Math.max(2, Math.min(8, 200 / ticks)) : Math.max(8, Math.min(36, 720 / ticks));
    const width = Math.ceil(left + ticks * u + 4);
    const height = top + steps.length * lane + 2;
    const svg = s("svg", { class: compact ? "tl mini" : "tl", width, height, viewBox: `0 0 ${width} ${height}` });
    const x = (tick) => left + tick * u;
    const laneTop = (i) => top + i * lane;
    if (!compact) {
      steps.forEach((step, i) => {
        svg.append(s("rect", { class: "lane" + (i % 2 ? " odd" : ""), x: 0, y: laneTop(i), width, height: lane }));
        const label = step.id.length > 22 ? step.id.slice(0, 21) + "…" : step.id;
        svg.append(s("text", { x: 4, y: laneTop(i) + lane / 2 + 4 }, label,
          s("title", {}, `${step.id}${step.name ? " (" + step.name + ")" : ""}: ${step.tool}` +
            (step.compensator ? `, undone by ${step.compensator}` : ", no compensator"))));
      });
    }
    if (tl.rollback_at !== undefined) {
      const at = x(tl.rollback_at) + u / 2;
      svg.append(s("line", { class: "rollback", x1: at, y1: compact ? 0 : 2, x2: at, y2: height }));
      if (!compact) svg.append(s("text", { class: "axis", x: at + 3, y: 10 }, "rollback"));
    }
    for (const [laneNo, phase, start, end, outcome, attempt] of tl.bars) {
      const step = steps[laneNo];
      svg.append(s("rect", {
        class: `bar ${phaseName(phase)} ${outcome}`, x: x(start) + 1, y: laneTop(laneNo) + (lane - barH) / 2,
        width: Math.max((end - start + 1) * u - 2, 2), height: barH, rx: compact ? 0 : 2,
      }, s("title", {}, `${step ? step.id : laneNo} · ${phaseName(phase)} attempt ${attempt}: ${outcome}`)));
    }
    for (const [laneNo, phase, fault, tick] of tl.faults) {
      const step = steps[laneNo];
      const cx = tick === null ? left + 5 : x(tick) + Math.min(u / 2, 8);
      const y = laneTop(laneNo) + (lane - barH) / 2;
      const r = compact ? 3 : 6;
      const title = `fault: ${fault} on ${step ? step.id : laneNo}'s ${phaseName(phase)}` +
        (tick === null ? " (never reached)" : "");
      svg.append(s("polygon", {
        class: "fault" + (tick === null ? " missed" : ""),
        points: `${cx - r},${y - r} ${cx + r},${y - r} ${cx},${y + 1}`,
      }, s("title", {}, title)));
    }
    return svg;
  }

  function timelineOf(saga, c, compact) {
    if (!c.timeline) {
      return h("span", { class: "muted no-timeline" },
        compact ? "concurrent: no timeline" : "Steps ran concurrently here: their order is a race, so no timeline is drawn; " +
          `the deterministic twin ${c.id.replace(/@concurrent$/, "")} has one.`);
    }
    return timeline(saga.steps, c.timeline, compact);
  }

  const faultText = (c) => c.faults.length ? c.faults.map(([step, phase, fault]) => `${step} · ${phase} · ${fault}`).join("; ") : "none";

  function diffView(diff) {
    const table = h("table", {},
      h("colgroup", {}, h("col", { class: "change" }), h("col", { class: "doc" }), h("col", { class: "field" }), h("col", {}), h("col", {})),
      h("thead", {}, h("tr", {}, ["change", "document", "field", "expected", "found"].map((x) => h("th", {}, x)))),
      h("tbody", {}, diff.flatMap((d) => d.fields.map(([field, expected, found]) =>
        h("tr", { class: "diff-row" },
          h("td", {}, d.change), h("td", { class: "mono" }, `${d.namespace}/${d.key}`),
          h("td", { class: "mono" }, field || "(whole document)"),
          h("td", { class: "mono expected" }, expected), h("td", { class: "mono found" }, found))))));
    const docs = diff.map((d) => h("details", { class: "whole" },
      h("summary", {}, `whole document ${d.namespace}/${d.key}`),
      h("div", { class: "docs" },
        h("div", {}, h("h4", {}, "expected"), h("pre", {}, d.expected ?? "(absent)")),
        h("div", {}, h("h4", {}, "found"), h("pre", {}, d.found ?? "(absent)")))));
    return h("div", { class: "diff" }, h("h4", {}, `State diff: ${plural(diff.length, "document")}`), table, docs);
  }

  function replayView(command) {
    const code = h("code", { class: "replay-cmd" }, command);
    const button = h("button", { type: "button" }, "Copy");
    button.addEventListener("click", () => {
      const done = () => { button.textContent = "Copied"; };
      if (navigator.clipboard) navigator.clipboard.writeText(command).then(done, () => select(code));
      else select(code);
    });
    return h("div", {}, h("h4", {}, "Replay"), h("div", { class: "replay" }, h("pre", {}, code), button));
  }

  function select(node) {
    const range = document.createRange();
    range.selectNodeContents(node);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  function failingCase(saga, c, sagaNo, caseNo) {
    const facts = [
      ["faults", faultText(c)], ["expected", c.expected], ["observed", c.observed],
      c.failed_step ? ["failed step", c.failed_step] : null,
      c.compensated ? ["compensated", c.compensated.join(" → ")] : null,
      c.compensation_failed ? ["compensation gave up", c.compensation_failed.join(", ")] : null,
      c.timeline && c.timeline.error ? ["error", c.timeline.error] : null,
      c.ledger_changes ? ["ledger changes", c.ledger_changes.join("; ")] : null,
    ].filter(Boolean);
    return h("article", { class: "case " + (c.pass ? "pass" : "fail"), id: `case-${sagaNo}-${caseNo}` },
      h("h3", {}, h("span", { class: "badge " + (c.pass ? "pass" : "fail") }, c.pass ? "PASS" : "FAIL"),
        h("code", { class: "case-id" }, c.id), h("span", { class: "kind" }, c.kind + (c.concurrent ? " · concurrent" : ""))),
      h("p", { class: "reason" }, c.reason),
      h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
      h("div", { class: "timeline" }, timelineOf(saga, c, false)),
      c.diff ? diffView(c.diff) : null,
      c.replay ? replayView(c.replay) : null);
  }

  function passingCases(saga, cases) {
    if (!cases.length) return null;
    const rows = cases.map((c) => h("tr", { class: "case-row" },
      h("td", {}, h("code", {}, c.id)), h("td", {}, c.kind), h("td", { class: "mono" }, faultText(c)),
      h("td", {}, c.observed), h("td", {}, timelineOf(saga, c, true)),
      h("td", { class: "reason-cell" }, c.reason)));
    return h("details", { class: "passing" },
      h("summary", {}, `${plural(cases.length, "passing case")}`),
      h("table", { class: "cases" },
        h("thead", {}, h("tr", {}, ["case", "kind", "faults", "observed", "timeline", "verdict"].map((x) => h("th", {}, x)))),
        h("tbody", {}, rows)));
  }

  function sagaSection(saga, sagaNo) {
    const m = saga.metrics;
    const failing = saga.cases.map((c, i) => [c, i]).filter(([c]) => !c.pass);
    return h("section", { class: "saga", id: `saga-${sagaNo}` },
      h("h2", {}, saga.name),
      h("p", { class: "muted" }, h("code", {}, saga.file),
        ` · ${plural(m.cases, "case")}, ${m.passed} passed, ${m.failed} failed`),
      problems(saga.problems, `problems-${sagaNo}`),
      failing.map(([c, i]) => failingCase(saga, c, sagaNo, i)),
      passingCases(saga, saga.cases.filter((c) => c.pass)));
  }

  const app = document.getElementById("app");
  app.replaceChildren();
  fill(app, [header(), summary(), legend(), data.sagas.map(sagaSection)]);
  document.title = `sagabox verify: ${data.passed ? "passed" : "FAILED"}, ${data.totals.cases} cases`;
})();
