// Every Corral page: the questions waiting for this person, live (docs/attention.md).
//
// One socket (/ws/attention/) per page brings {"attention": {count, questions}}: the list of
// the questions this person may answer, newest first, computed for them by the server. The
// page counts them in its title ("(2) Corral"), badges its icon, keeps the top bar's inbox
// count, and — when this browser opted in (the notifications page) and the browser permits —
// shows one system notification per new question, through the service worker so that it
// opens the card when clicked, with a short sound if asked for. It tells the server whether
// the page is on screen (Web Push goes only to people with none on screen). Other scripts
// (the inbox) follow the same list through the "corral:attention" event.
(function () {
  "use strict";
  const link = document.getElementById("inbox-link");
  if (!link || !window.WebSocket) return;
  const countEl = document.getElementById("inbox-count");
  const PREFIX = /^\(\d+\) /;
  let count = parseInt(countEl && countEl.textContent, 10) || 0;
  let socket = null;
  let retry = 1000;

  // --- the service worker: the app shell offline, the push handler, notification clicks.
  // Resolves to the active registration (showNotification needs one), or rejects.
  const registered = "serviceWorker" in navigator && window.isSecureContext
    ? navigator.serviceWorker.register(link.dataset.sw, { scope: "/" }).then(function (reg) {
      return reg.active ? reg : navigator.serviceWorker.ready;
    }) : Promise.reject(new Error("no service worker here"));
  registered.catch(function (err) { console.warn("Corral's service worker is not running:", err); });

  // --- the title and the icon.
  function applyTitle() {
    const base = document.title.replace(PREFIX, "");
    const want = count > 0 ? "(" + count + ") " + base : base;
    if (document.title !== want) document.title = want;
  }
  // Another script may set the title (session.js follows a rename): keep the count in front.
  const titleEl = document.querySelector("title");
  if (titleEl && window.MutationObserver) {
    new MutationObserver(applyTitle).observe(titleEl, { childList: true, characterData: true, subtree: true });
  }

  function applyIcon() {
    const icon = document.querySelector('link[rel="icon"]');
    if (!icon) return;
    const want = count > 0 ? link.dataset.faviconAlert : link.dataset.favicon;
    if (icon.getAttribute("href") !== want) {
      // A new element: browsers do not always notice a changed href on the same one.
      const fresh = icon.cloneNode();
      fresh.setAttribute("href", want);
      fresh.dataset.badge = count > 0 ? "1" : "0";
      icon.replaceWith(fresh);
    }
  }

  function applyCount() {
    if (countEl) {
      countEl.textContent = String(count);
      countEl.hidden = count === 0;
      countEl.setAttribute("aria-label", count + " waiting");
    }
    link.dataset.count = String(count);
    applyTitle();
    applyIcon();
  }

  // --- system notifications and sound (opted in per browser: localStorage).
  function wants(what) {
    try { return localStorage.getItem("corral." + what) === "on"; } catch (err) { return false; }
  }

  // Each question is told once per browser, whichever of its tabs hears of it first
  // (localStorage is shared by the tabs; the notification's tag folds any race into one).
  function firstToTell(key) {
    let told = [];
    try { told = JSON.parse(localStorage.getItem("corral.told") || "[]"); } catch (err) { told = []; }
    if (told.indexOf(key) !== -1) return false;
    told.push(key);
    try { localStorage.setItem("corral.told", JSON.stringify(told.slice(-200))); } catch (err) { /* private mode */ }
    return true;
  }

  function showing(question) {
    // The person is looking at this very session: the card is in front of them.
    const root = document.getElementById("session");
    return document.visibilityState === "visible" && root && root.dataset.sessionId === String(question.session_id);
  }

  // Through the service worker when there is one (its click handler opens the card, even
  // once this tab is closed; a phone's browser has no other way); else a page notification.
  function notify(question) {
    const options = { body: question.body, tag: question.tag, data: { url: question.url }, icon: "/static/corral/icon-192.png" };
    return registered.then(function (reg) {
      return reg.showNotification(question.title, options);
    }, function () {
      const shown = new Notification(question.title, options);
      shown.onclick = function () { window.focus(); location.href = question.url; };
    });
  }

  let audio = null;
  function chime() {
    const Context = window.AudioContext || window.webkitAudioContext;
    if (!Context) return;
    try {
      audio = audio || new Context();
      const tone = audio.createOscillator();
      const gain = audio.createGain();
      tone.frequency.value = 880;
      gain.gain.setValueAtTime(0.15, audio.currentTime);
      gain.gain.exponentialRampToValueAtTime(0.001, audio.currentTime + 0.4);
      tone.connect(gain).connect(audio.destination);
      tone.start();
      tone.stop(audio.currentTime + 0.4);
    } catch (err) { /* a browser that allows no sound before a click: silence */ }
  }

  function tell(questions) {
    const allowed = wants("notify") && window.Notification && Notification.permission === "granted";
    let rang = false;
    questions.forEach(function (question) {
      if (showing(question) || !firstToTell(question.key)) return;
      if (allowed) notify(question).catch(function (err) { console.warn("notification not shown:", err); });
      if (wants("sound") && !rang) { chime(); rang = true; }
    });
  }

  // --- the socket.
  function sendVisibility() {
    if (socket && socket.readyState === WebSocket.OPEN) {
      socket.send(JSON.stringify({ visible: document.visibilityState === "visible" }));
    }
  }
  document.addEventListener("visibilitychange", sendVisibility);

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + link.dataset.wsPath);
    socket.onopen = function () { retry = 1000; sendVisibility(); };
    socket.onmessage = function (e) {
      const msg = JSON.parse(e.data);
      if (!msg.attention) return;
      count = msg.attention.count;
      applyCount();
      tell(msg.attention.questions);
      document.dispatchEvent(new CustomEvent("corral:attention", { detail: msg.attention }));
    };
    socket.onclose = function (e) {
      if (e.code === 4401) return;  // logged out: the page says so at the next click
      setTimeout(connect, retry);
      retry = Math.min(retry * 2, 15000);
    };
  }
  applyCount();
  connect();
})();
