// Live transcript for the session page (docs/behaviour.md §12, docs/behaviour.md C17, C19).
//
// The socket is owned by this script, not by any element htmx may swap, so a swap never
// closes it or opens a second one. Every server message is {seq, ops}; seq only grows.
// On reconnect the page asks for everything after the last seq it applied, so nothing is
// lost or shown twice. A close with one of the codes the page has a sentence for
// (#conn-closed) ends the retries; docs/live-page.md lists them.
(function () {
  "use strict";
  const root = document.getElementById("session");
  if (!root) return;
  let lastSeq = parseInt(root.dataset.lastSeq || "0", 10);
  let socket = null;
  let retry = 500;
  const conn = document.getElementById("conn-state");

  function setConn(state) {
    if (conn) {
      conn.dataset.state = state;
      conn.textContent = state === "live" || state === "closed" ? state : state + "…";
    }
  }

  function apply(op) {
    if (op.op === "append") {
      const target = document.getElementById(op.target);
      if (target) target.insertAdjacentHTML("beforeend", op.html);
    } else if (op.op === "replace") {
      const el = document.getElementById(op.id);
      if (el) el.outerHTML = op.html;
    } else if (op.op === "remove") {
      const el = document.getElementById(op.id);
      if (el) el.remove();
    } else if (op.op === "text") {
      // Stored text: it goes before the block's tail, which it replaces (docs/live-page.md).
      const el = document.getElementById(op.id);
      const raw = el && el.querySelector(".raw");
      const tail = raw && raw.querySelector(".tail");
      if (raw) raw.insertBefore(document.createTextNode(op.text), tail);  // text, never markup
      if (tail) tail.textContent = "";
    } else if (op.op === "tail") {
      // Text streamed but not stored yet, shown until the stored text replaces it.
      const el = document.getElementById(op.id);
      const tail = el && el.querySelector(".raw .tail");
      if (tail) tail.textContent = op.text;  // text, never markup
    } else if (op.op === "value") {
      const el = document.getElementById(op.id);
      if (el && el.value !== op.value) el.value = op.value;
    } else if (op.op === "reload") {
      location.reload();  // the user's rights changed: the server draws the page again
      return;
    } else if (op.op === "status") {
      const badge = document.getElementById("status-badge");
      if (badge) { badge.outerHTML = op.html.replace("<span ", '<span id="status-badge" '); }
      root.dataset.status = op.status;
    }
    // New markup may carry hx- attributes (question buttons, withdraw): let htmx see it.
    if (window.htmx) {
      const fresh = op.op === "append" ? (document.getElementById(op.target) || {}).lastElementChild
        : op.op === "replace" ? document.getElementById(op.id) : null;
      if (fresh) window.htmx.process(fresh);
    }
  }

  function nearBottom() {
    return window.innerHeight + window.scrollY >= document.body.scrollHeight - 80;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + root.dataset.wsPath + "?after=" + lastSeq);
    setConn("connecting");
    socket.onopen = function () {
      retry = 500;
      setConn("live");
      // A tail is never counted in lastSeq: the catch-up brings its text again, stored.
      document.querySelectorAll("#transcript .tail").forEach(function (t) { t.textContent = ""; });
    };
    socket.onmessage = function (e) {
      const msg = JSON.parse(e.data);
      if (msg.seq === undefined) {             // not a transcript event (who is watching): apply as is
        msg.ops.forEach(apply);
        return;
      }
      if (msg.seq <= lastSeq) return;          // already applied
      if (msg.seq !== lastSeq + 1) {           // a gap: start over from what we have
        socket.close();
        return;
      }
      const stick = nearBottom();
      msg.ops.forEach(apply);
      lastSeq = msg.seq;
      root.dataset.lastSeq = String(lastSeq);
      if (stick) window.scrollTo(0, document.body.scrollHeight);
    };
    socket.onclose = function (e) {
      // A close code the page has a sentence for is final: say why and how to go on
      // (log in again, back to the list, not shared any more) instead of retrying for ever.
      const reason = document.querySelector('#conn-closed [data-close-code="' + Number(e.code) + '"]');
      if (reason) {
        reason.hidden = false;
        reason.parentElement.hidden = false;
        setConn("closed");
        const composer = document.getElementById("composer-wrap");
        if (composer) composer.remove();  // nothing sent from here would be seen
        return;
      }
      setConn("reconnecting");
      setTimeout(connect, retry);
      retry = Math.min(retry * 2, 5000);
    };
  }

  // Enter sends, Shift+Enter makes a new line.
  document.addEventListener("keydown", function (e) {
    if (e.target && e.target.id === "id_text" && e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      const form = e.target.form;
      if (form) form.requestSubmit();
    }
  });
  // After a send the composer is swapped: keep the focus in the text box.
  document.body.addEventListener("htmx:afterSwap", function (e) {
    if (e.target && e.target.id === "composer-wrap") {
      const box = document.getElementById("id_text");
      if (box) box.focus();
    }
  });

  // htmx never swaps an error response. A request too large for the server (413) gets a
  // sentence from it: show it where the person typed (the composer), else in #flash.
  document.body.addEventListener("htmx:responseError", function (e) {
    const xhr = e.detail.xhr;
    if (!xhr || xhr.status !== 413) return;
    let slot = e.detail.elt && e.detail.elt.id === "composer" ? document.getElementById("composer-error") : null;
    if (!slot) {
      slot = document.createElement("p");
      slot.className = "error";
      const flash = document.getElementById("flash");
      if (!flash) return;
      flash.replaceChildren(slot);
    }
    slot.textContent = xhr.responseText;  // text, never markup
    slot.hidden = false;
  });

  connect();
})();
