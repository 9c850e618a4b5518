// The inbox follows the questions waiting for this person (docs/attention.md): a question
// answered anywhere leaves at once; a new one is fetched (/inbox/entries/, drawn by the
// server as its session draws it) and put in its place. Cards already shown are kept as they
// are, so a "show all" opened or an answer on its way is never redrawn under the reader.
(function () {
  "use strict";
  const inbox = document.getElementById("inbox");
  if (!inbox) return;
  let fetching = null;

  function entries() {
    return Array.prototype.slice.call(document.querySelectorAll("#inbox-entries > .inbox-entry"));
  }

  function syncEmpty() {
    const empty = document.getElementById("inbox-empty");
    if (empty) empty.hidden = entries().length > 0;
  }

  function merge(html) {
    const list = document.getElementById("inbox-entries");
    const fresh = document.createElement("div");
    fresh.innerHTML = html;
    const want = fresh.querySelectorAll(".inbox-entry");
    const have = {};
    entries().forEach(function (el) { have[el.dataset.key] = el; });
    const keep = {};
    want.forEach(function (el) {
      const node = have[el.dataset.key] || el;
      keep[el.dataset.key] = true;
      list.appendChild(node);  // in the server's order: newest first
      if (node === el && window.htmx) window.htmx.process(node);
    });
    Object.keys(have).forEach(function (key) { if (!keep[key]) have[key].remove(); });
    syncEmpty();
  }

  function refetch() {
    if (fetching) return;
    fetching = fetch(inbox.dataset.entriesUrl, { credentials: "same-origin", headers: { "HX-Request": "true" } })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(merge)
      .catch(function (err) { console.warn("inbox not refreshed:", err); })
      .finally(function () { fetching = null; });
  }

  document.addEventListener("corral:attention", function (e) {
    const keys = {};
    e.detail.questions.forEach(function (q) { keys[q.key] = true; });
    entries().forEach(function (el) { if (!keys[el.dataset.key]) el.remove(); });
    syncEmpty();
    const shown = {};
    entries().forEach(function (el) { shown[el.dataset.key] = true; });
    if (e.detail.questions.some(function (q) { return !shown[q.key]; })) refetch();
  });
})();
