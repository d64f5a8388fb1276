// A FIX 4.4 venue for the tests, on QuickFIX C++ (Debian's libquickfix-dev): the session layer
// (logon, heartbeats, sequence numbers, resends) is QuickFIX's; the business logic is ours.
//
//   fix-acceptor <settings> <journal.jsonl> <control-port>
//
// Sessions are those of <settings> (SenderCompID = the venue, TargetCompID = the account's
// login); each session's dictionary carries `Password=` (checked against Logon's 554; 553 must
// equal the login). Per account: hedging positions filled at fixed quotes, NewOrderSingle (D)
// market orders and immediate-or-cancel limit orders (PosMaintRptID 721 names the position a
// closing order reduces), duplicate
// ClOrdIDs rejected (OrdRejReason 6), OrderStatusRequest (H), RequestForPositions (AN) answered
// with an ack (AO) and PositionReports (AP), updates pushed when subscribed (263=1),
// SecurityListRequest (x) answered with every symbol and its contract size (231), and
// ExecutionReports for trades placed by the hand client pushed to the account's session (drop
// copy). Stop losses and take profits are resting orders on a position, as cTrader's FIX API
// takes them: a stop (OrdType 3, StopPx) or a limit (OrdType 2, Price, not IOC) on the opposite
// side with PosMaintRptID naming the position, acknowledged New, cancelled by
// OrderCancelRequest (F), filled when `quote` moves the price to them, and cancelled by the venue
// when their position is gone. Entry orders (pending orders: a limit, OrdType 2 not IOC, or a
// stop, OrdType 3, without PosMaintRptID) rest until `quote` reaches their price, when they fill
// and open a position (the fill's report carries its PosMaintRptID); they are refused on the wrong
// side of the market, good till cancelled (TimeInForce 1) or till their ExpireTime (59=6, 126),
// when the venue expires them (ExecType C); OrderCancelReplaceRequest (G) changes their price or
// expiry (the OrderID stays) and OrderCancelRequest (F) cancels them; OrderMassStatusRequest (AF)
// lists every resting order (ExecType I, TotNumReports 911, LastRptRequested 912), and the hand
// client's entry orders reach the account's sessions as reports (New, Replaced, Canceled, the
// fill), as its trades do. Every request is journaled
// in the simulated broker's JSON-lines format (entry orders as `place`, `amend`, `cancel`),
// `client` from SenderSubID (50); so are Logouts the client sends (`logout`), and Logons that
// QuickFIX's acceptor refuses because a session of the account is still connected (one logon
// per account: `login`, accepted false, as a venue that allows one session per account does).
//
// The control port takes one command per line and answers one line:
//   open <login> <symbol> <buy|sell> <lots>      -> ok <ticket>     (the hand client)
//   close <login> <ticket> <lots>                -> ok <ticket>
//   place <login> <symbol> <buy|sell> <limit|stop> <price> <lots> [<expiry ms>]
//                                                -> ok <OrderID>    (the hand client's entry order)
//   amend <login> <OrderID> <price>              -> ok
//   cancel <login> <OrderID>                     -> ok
//   positions <login>                            -> ok <ticket>:<symbol>:<side>:<lots> ...
//   orders <login>                               -> ok <OrderID>:<symbol>:<side>:<limit|stop>:
//                                                   <price>:<lots>:<expiry ms or 0> ... (entry
//                                                   orders resting)
//   quote <symbol> <bid> <ask>                   -> ok <fills> (moves the quote; resting stop
//                                                   and limit orders it reaches are filled)
//   fault <name> <on|off>                        -> ok, where <name> is one of
//     drop_after_fill  the connection drops after a fill, before its report (never sent)
//     gap_after_fill   the connection drops after a fill; the report goes to the session's store
//                      (the client gets it by ResendRequest after its next logon)
//     lose_reply       fills, and entry orders' acknowledgements, are never reported
//     refuse_logon     every Logon is refused
//     no_drop_copy     the hand client's trades reach sessions only as PositionReports of a
//                      subscription (no ExecutionReport)
//     no_ao            RequestForPositions is answered without RequestForPositionsAck: every
//                      PositionReport carries the count (TotNumReports 727), and "none" is one
//                      report with PosReqResult 728 = 2 (as cTrader's FIX API answers)
//   forget <login>                               -> ok (the venue forgets the account's ClOrdIDs,
//                                                   as after a trading-day roll; resting orders
//                                                   stay)
//   reset <login>                                -> ok (the venue resets the session's sequence
//                                                   numbers: a Logout, then both sides at 1)
//   renumber <login>                             -> ok (the venue drops the connection with no
//                                                   Logout and starts both sides again at 1, as
//                                                   a venue restarted without its store does)
//   quit                                         -> ok (and the process exits)

#include "quickfix/Application.h"
#include "quickfix/FileStore.h"
#include "quickfix/FileLog.h"
#include "quickfix/Log.h"
#include "quickfix/MessageCracker.h"
#include "quickfix/Mutex.h"
#include "quickfix/Session.h"
#include "quickfix/SessionSettings.h"
#include "quickfix/SocketAcceptor.h"
#include "quickfix/Values.h"
#include "quickfix/fix44/ExecutionReport.h"
#include "quickfix/fix44/NewOrderSingle.h"
#include "quickfix/fix44/OrderCancelReject.h"
#include "quickfix/fix44/OrderCancelReplaceRequest.h"
#include "quickfix/fix44/OrderMassStatusRequest.h"
#include "quickfix/fix44/OrderCancelRequest.h"
#include "quickfix/fix44/OrderStatusRequest.h"
#include "quickfix/fix44/PositionReport.h"
#include "quickfix/fix44/RequestForPositions.h"
#include "quickfix/fix44/RequestForPositionsAck.h"
#include "quickfix/fix44/SecurityList.h"
#include "quickfix/fix44/SecurityListRequest.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <ctime>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fcntl.h>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Quote {
  double bid, ask, contract;
};

const std::map<std::string, Quote> QUOTES = {
    {"EURUSD", {1.10000, 1.10010, 100000}},
    {"GBPUSD", {1.25000, 1.25012, 100000}},
    {"XAUUSD", {2000.00, 2000.30, 100}},
};

struct Position {
  std::string symbol;
  char side;  // '1' buy, '2' sell
  double units;
  double price;
};

struct Order {
  std::string order_id;
  char status;  // OrdStatus
  std::string symbol;
  char side;
  double units;
  double price;
  long position;
  bool entry = false;  // an entry order (its position: the one its fill opened)
};

// A resting order: one protecting a position (cTrader's way of a stop loss or take profit: a stop,
// OrdType 3, StopPx 99, or a limit, OrdType 2, Price 44, not IOC, on the opposite side, naming
// the position with PosMaintRptID 721), or an entry order (position 0) that opens one.
struct Pending {
  char type;  // OrdType
  double price;
  char side;
  double units;
  long position;
  std::string symbol;
  long long expire_ms;  // entry orders: 0, good till cancelled
};

// FIX UTCTimestamp (YYYYMMDD-HH:MM:SS[.sss]) as Unix ms; -1 when it is not one.
long long parse_utc(const std::string& t) {
  std::tm tm{};
  int ms = 0;
  if (t.size() < 17 || std::sscanf(t.c_str(), "%4d%2d%2d-%2d:%2d:%2d", &tm.tm_year, &tm.tm_mon,
                                   &tm.tm_mday, &tm.tm_hour, &tm.tm_min, &tm.tm_sec) != 6)
    return -1;
  if (t.size() >= 21 && t[17] == '.') ms = std::atoi(t.substr(18, 3).c_str());
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return static_cast<long long>(timegm(&tm)) * 1000 + ms;
}

struct Account {
  std::map<long, Position> positions;
  std::map<std::string, Pending> pending;  // by ClOrdID
  std::map<std::string, Order> orders;  // by ClOrdID
  std::set<std::string> subscriptions;  // PosReqIDs of a subscribed RequestForPositions
};

long long now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

long long now_ms() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string opt_str(const std::string& s) { return s.empty() ? "null" : json_str(s); }

class Venue : public FIX::Application, public FIX::MessageCracker {
 public:
  Venue(const FIX::SessionSettings& settings, const std::string& journal)
      : settings_(settings), journal_(journal, std::ios::app) {}

  std::atomic<bool> drop_after_fill{false};
  std::atomic<bool> lose_reply{false};
  std::atomic<bool> refuse_logon{false};
  std::atomic<bool> gap_after_fill{false};
  std::atomic<bool> no_drop_copy{false};
  std::atomic<bool> no_ao{false};

  // A Logon QuickFIX dropped because a session of its identity is still connected (its global
  // log's "Session not found for incoming message"), journaled as a refused login.
  void refused_logon(const std::string& message) {
    auto field = [&](const std::string& tag) {
      std::string key = std::string(1, '\x01') + tag + "=";
      size_t at = message.find(key);
      if (at == std::string::npos) return std::string();
      at += key.size();
      return message.substr(at, message.find('\x01', at) - at);
    };
    if (field("35") != "A") return;
    std::string who = field("49");
    bool known = false;
    for (auto& id : settings_.getSessions())
      if (login(id) == who) known = true;
    std::lock_guard<std::mutex> g(mutex_);
    journal(who, field("50"), "login", "", 0, ' ', 0, "", false,
            known ? "a session of this account is already logged on" : "unknown session");
  }

  // --- FIX::Application
  void onCreate(const FIX::SessionID&) override {}
  void onLogon(const FIX::SessionID& id) override {
    std::lock_guard<std::mutex> g(mutex_);
    logged_on_.insert(id);
  }
  void onLogout(const FIX::SessionID& id) override {
    std::lock_guard<std::mutex> g(mutex_);
    logged_on_.erase(id);
    accounts_[login(id)].subscriptions.clear();
  }
  void toAdmin(FIX::Message&, const FIX::SessionID&) override {}
  void toApp(FIX::Message&, const FIX::SessionID&) throw(FIX::DoNotSend) override {}

  void fromAdmin(const FIX::Message& message, const FIX::SessionID& id) throw(
      FIX::FieldNotFound, FIX::IncorrectDataFormat, FIX::IncorrectTagValue,
      FIX::RejectLogon) override {
    FIX::MsgType type;
    message.getHeader().getField(type);
    if (type == FIX::MsgType_Logout) {
      std::lock_guard<std::mutex> g(mutex_);
      journal(login(id), sub_id(message), "logout", "", 0, ' ', 0, "", true, "");
      return;
    }
    if (type != FIX::MsgType_Logon) return;
    std::string user = message.isSetField(553) ? message.getField(553) : "";
    std::string pass = message.isSetField(554) ? message.getField(554) : "";
    std::string client = sub_id(message);
    const FIX::Dictionary& d = settings_.get(id);
    std::string want = d.has("Password") ? d.getString("Password") : "";
    std::string reason;
    if (refuse_logon) reason = "logon refused (fault switch)";
    else if (user != login(id)) reason = "unknown user";
    else if (pass != want) reason = "wrong password";
    std::lock_guard<std::mutex> g(mutex_);
    journal(login(id), client, "login", "", 0, ' ', 0, "", reason.empty(), reason);
    if (!reason.empty()) throw FIX::RejectLogon(reason);
  }

  void fromApp(const FIX::Message& message, const FIX::SessionID& id) throw(
      FIX::FieldNotFound, FIX::IncorrectDataFormat, FIX::IncorrectTagValue,
      FIX::UnsupportedMessageType) override {
    crack(message, id);
  }

  // --- messages
  void onMessage(const FIX44::NewOrderSingle& m, const FIX::SessionID& id) override {
    FIX::ClOrdID cl;
    FIX::Side side;
    FIX::Symbol symbol;
    FIX::OrderQty qty;
    FIX::OrdType type;
    m.get(cl);
    m.get(side);
    m.get(symbol);
    m.get(qty);
    m.get(type);
    long position = 0;
    bool bad_position = false;
    if (m.isSetField(721)) {
      const std::string text = m.getField(721);
      char* end = nullptr;
      position = std::strtol(text.c_str(), &end, 10);
      bad_position = text.empty() || *end != '\0' || position <= 0;
    }
    std::string client = sub_id(m);
    std::string who = login(id);
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[who];
    bool resting = position > 0 && !bad_position &&
                   (type.getValue() == FIX::OrdType_STOP ||
                    (type.getValue() == FIX::OrdType_LIMIT &&
                     !(m.isSetField(59) && m.getField(59) == "3")));
    if (resting) {
      protect(g, acc, who, client, id, m, cl.getValue(), type.getValue(), side.getValue(),
              symbol.getValue(), qty.getValue(), position);
      return;
    }
    bool entry = !m.isSetField(721) &&
                 (type.getValue() == FIX::OrdType_STOP ||
                  (type.getValue() == FIX::OrdType_LIMIT &&
                   !(m.isSetField(59) && m.getField(59) == "3")));
    if (entry) {
      enter(g, acc, who, client, id, m, cl.getValue(), type.getValue(), side.getValue(),
            symbol.getValue(), qty.getValue());
      return;
    }
    auto quote = quotes_.find(symbol.getValue());
    std::string reason;
    int rej = 0;
    if (acc.orders.count(cl.getValue())) {
      reason = "duplicate ClOrdID";
      rej = FIX::OrdRejReason_DUPLICATE_ORDER;
    } else if (type.getValue() != FIX::OrdType_MARKET &&
               !(type.getValue() == FIX::OrdType_LIMIT && m.isSetField(44) &&
                 m.isSetField(59) && m.getField(59) == "3")) {
      reason = "only market orders and immediate-or-cancel limit orders";
      rej = FIX::OrdRejReason_UNSUPPORTED_ORDER_CHARACTERISTIC;
    } else if (quote == quotes_.end()) {
      reason = "unknown symbol";
      rej = FIX::OrdRejReason_UNKNOWN_SYMBOL;
    } else if (qty.getValue() <= 0) {
      reason = "invalid quantity";
      rej = FIX::OrdRejReason_INCORRECT_QUANTITY;
    } else if (bad_position) {
      reason = "PosMaintRptID is not a position id";
      rej = FIX::OrdRejReason_OTHER;
    } else if (position != 0) {
      auto p = acc.positions.find(position);
      if (p == acc.positions.end()) {
        reason = "no such position";
        rej = FIX::OrdRejReason_OTHER;
      } else if (p->second.symbol != symbol.getValue()) {
        reason = "the position is on another symbol";
        rej = FIX::OrdRejReason_OTHER;
      } else if (p->second.side == side.getValue()) {
        reason = "a closing order must take the opposite side";
        rej = FIX::OrdRejReason_OTHER;
      } else if (qty.getValue() > p->second.units + 1e-9) {
        reason = "quantity above the position's";
        rej = FIX::OrdRejReason_INCORRECT_QUANTITY;
      }
    }
    std::string action = position != 0 || bad_position ? "close" : "open";
    // Volumes in lots, as the simulated broker journals them (-1: not convertible).
    double lots = quote == quotes_.end() ? -1 : qty.getValue() / quote->second.contract;
    // A close is journaled with the position's side, as the simulated broker does.
    char journal_side = side.getValue();
    if (position != 0 && acc.positions.count(position))
      journal_side = acc.positions.at(position).side;
    if (!reason.empty()) {
      if (rej != FIX::OrdRejReason_DUPLICATE_ORDER) {
        acc.orders[cl.getValue()] = Order{next_id(), FIX::OrdStatus_REJECTED, symbol.getValue(),
                                          side.getValue(), qty.getValue(), 0, position};
      }
      journal(who, client, action, symbol.getValue(), position, journal_side, lots,
              cl.getValue(), false, reason);
      FIX44::ExecutionReport er = report(cl.getValue(), next_id(), FIX::ExecType_REJECTED,
                                         FIX::OrdStatus_REJECTED, symbol.getValue(),
                                         side.getValue(), qty.getValue(), 0, 0, position);
      er.set(FIX::OrdRejReason(rej));
      er.set(FIX::Text(reason));
      g.unlock();
      send(er, id);
      return;
    }
    double price = side.getValue() == FIX::Side_BUY ? quote->second.ask : quote->second.bid;
    if (type.getValue() == FIX::OrdType_LIMIT) {
      double limit = std::stod(m.getField(44));
      bool beyond = side.getValue() == FIX::Side_BUY ? price > limit + 1e-9 : price < limit - 1e-9;
      if (beyond) {
        // Immediate-or-cancel: nothing fills, the order is cancelled.
        acc.orders[cl.getValue()] = Order{next_id(), FIX::OrdStatus_CANCELED, symbol.getValue(),
                                          side.getValue(), qty.getValue(), 0, position};
        journal(who, client, action, symbol.getValue(), position, journal_side, lots,
                cl.getValue(), false, "price beyond the limit");
        FIX44::ExecutionReport er = report(cl.getValue(), acc.orders[cl.getValue()].order_id,
                                           FIX::ExecType_CANCELED, FIX::OrdStatus_CANCELED,
                                           symbol.getValue(), side.getValue(), qty.getValue(), 0,
                                           0, position);
        er.set(FIX::Text("price beyond the limit"));
        g.unlock();
        send(er, id);
        return;
      }
    }
    Position before = position != 0 ? acc.positions.at(position) : Position{};
    long ticket = fill(acc, symbol.getValue(), side.getValue(), qty.getValue(), price, position);
    acc.orders[cl.getValue()] = Order{next_id(), FIX::OrdStatus_FILLED, symbol.getValue(),
                                      side.getValue(), qty.getValue(), price, ticket};
    journal(who, client, action, symbol.getValue(), ticket, journal_side, lots, cl.getValue(),
            true, "");
    FIX44::ExecutionReport er =
        report(cl.getValue(), acc.orders[cl.getValue()].order_id, FIX::ExecType_TRADE,
               FIX::OrdStatus_FILLED, symbol.getValue(), side.getValue(), qty.getValue(),
               qty.getValue(), price, ticket);
    std::vector<FIX44::PositionReport> updates = subscribed_reports(acc, ticket, before);
    std::vector<FIX44::ExecutionReport> orphans = cancel_orphans(acc, ticket);
    g.unlock();
    for (auto& o : orphans) send(o, id);
    if (drop_after_fill) {
      if (FIX::Session* s = FIX::Session::lookupSession(id)) s->disconnect();
      return;
    }
    if (gap_after_fill) {
      // The report is sent (into the session's store) after the connection is gone: the
      // client gets it by ResendRequest when it logs on again.
      if (FIX::Session* s = FIX::Session::lookupSession(id)) s->disconnect();
      send(er, id);
      for (auto& u : updates) send(u, id);
      return;
    }
    if (lose_reply) return;
    send(er, id);
    for (auto& u : updates) send(u, id);
  }

  void onMessage(const FIX44::OrderStatusRequest& m, const FIX::SessionID& id) override {
    FIX::ClOrdID cl;
    m.get(cl);
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[login(id)];
    auto o = acc.orders.find(cl.getValue());
    FIX44::ExecutionReport er =
        o == acc.orders.end()
            ? report(cl.getValue(), "NONE", FIX::ExecType_ORDER_STATUS, FIX::OrdStatus_REJECTED,
                     m.isSetField(55) ? m.getField(55) : "", FIX::Side_BUY, 0, 0, 0, 0)
            : report(cl.getValue(), o->second.order_id, FIX::ExecType_ORDER_STATUS,
                     o->second.status, o->second.symbol, o->second.side, o->second.units,
                     o->second.status == FIX::OrdStatus_FILLED ? o->second.units : 0,
                     o->second.price, o->second.position);
    if (o == acc.orders.end()) {
      er.set(FIX::OrdRejReason(FIX::OrdRejReason_UNKNOWN_ORDER));
      er.set(FIX::Text("unknown order"));
    }
    g.unlock();
    send(er, id);
  }

  void onMessage(const FIX44::RequestForPositions& m, const FIX::SessionID& id) override {
    FIX::PosReqID req;
    m.get(req);
    bool subscribe = m.isSetField(263) && m.getField(263) == "1";
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[login(id)];
    if (subscribe) acc.subscriptions.insert(req.getValue());
    FIX44::RequestForPositionsAck ack;
    ack.set(FIX::PosMaintRptID(next_id()));
    ack.set(req);
    ack.set(FIX::TotalNumPosReports(static_cast<int>(acc.positions.size())));
    ack.set(FIX::PosReqResult(FIX::PosReqResult_VALID_REQUEST));
    ack.set(FIX::PosReqStatus(FIX::PosReqStatus_COMPLETED));
    std::vector<FIX44::PositionReport> reports;
    for (auto& p : acc.positions) reports.push_back(position_report(req.getValue(), p.first, p.second));
    g.unlock();
    if (!no_ao) {
      send(ack, id);
    } else if (reports.empty()) {
      FIX44::PositionReport none;
      none.set(FIX::PosMaintRptID(next_id()));
      none.set(req);
      none.set(FIX::PosReqResult(FIX::PosReqResult_NO_POSITIONS_FOUND_THAT_MATCH_CRITERIA));
      none.setField(FIX::TotalNumPosReports(0));
      none.set(FIX::ClearingBusinessDate("20261130"));
      none.set(FIX::SettlPrice(0));
      none.set(FIX::SettlPriceType(FIX::SettlPriceType_FINAL));
      none.set(FIX::PriorSettlPrice(0));
      reports.push_back(none);
    } else {
      for (auto& r : reports) r.setField(FIX::TotalNumPosReports(static_cast<int>(reports.size())));
    }
    for (auto& r : reports) send(r, id);
  }

  void onMessage(const FIX44::SecurityListRequest& m, const FIX::SessionID& id) override {
    FIX::SecurityReqID req;
    m.get(req);
    FIX44::SecurityList list;
    list.set(req);
    list.set(FIX::SecurityResponseID(next_id()));
    list.set(FIX::SecurityRequestResult(FIX::SecurityRequestResult_VALID_REQUEST));
    for (auto& q : quotes_) {
      FIX44::SecurityList::NoRelatedSym sym;
      sym.set(FIX::Symbol(q.first));
      sym.set(FIX::ContractMultiplier(q.second.contract));
      sym.set(FIX::RoundLot(q.second.contract / 100));
      sym.set(FIX::MinTradeVol(q.second.contract / 100));
      list.addGroup(sym);
    }
    send(list, id);
  }

  void onMessage(const FIX44::OrderCancelRequest& m, const FIX::SessionID& id) override {
    FIX::ClOrdID cl;
    FIX::OrigClOrdID orig;
    m.get(cl);
    m.get(orig);
    std::string who = login(id);
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[who];
    auto p = acc.pending.find(orig.getValue());
    if (p == acc.pending.end()) {
      auto o = acc.orders.find(orig.getValue());
      bool known = o != acc.orders.end();
      bool was_entry = known && o->second.entry;
      journal(who, sub_id(m), was_entry ? "cancel" : "modify", known ? o->second.symbol : "",
              was_entry ? order_number(o->second) : 0, ' ', 0, cl.getValue(), false,
              "no such resting order");
      FIX44::OrderCancelReject reject = cancel_reject(
          cl, orig, known ? &o->second : nullptr, FIX::CxlRejResponseTo_ORDER_CANCEL_REQUEST,
          known ? FIX::CxlRejReason_TOO_LATE_TO_CANCEL : FIX::CxlRejReason_UNKNOWN_ORDER,
          known ? "too late to cancel: the order is not resting" : "no such resting order");
      g.unlock();
      send(reject, id);
      return;
    }
    Pending pending = p->second;
    acc.pending.erase(p);
    Order& order = acc.orders[orig.getValue()];
    order.status = FIX::OrdStatus_CANCELED;
    if (pending.position == 0)
      journal(who, sub_id(m), "cancel", order.symbol, order_number(order), pending.side,
              pending.units / quotes_.at(order.symbol).contract, cl.getValue(), true, "");
    else
      journal(who, sub_id(m), "modify", order.symbol, pending.position, pending.side, -1,
              cl.getValue(), true, "");
    FIX44::ExecutionReport er =
        report(cl.getValue(), order.order_id, FIX::ExecType_CANCELED, FIX::OrdStatus_CANCELED,
               order.symbol, pending.side, pending.units, 0, 0, pending.position);
    er.set(FIX::OrigClOrdID(orig.getValue()));
    g.unlock();
    send(er, id);
  }

  void onMessage(const FIX44::OrderCancelReplaceRequest& m, const FIX::SessionID& id) override {
    FIX::ClOrdID cl;
    FIX::OrigClOrdID orig;
    m.get(cl);
    m.get(orig);
    std::string who = login(id);
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[who];
    auto p = acc.pending.find(orig.getValue());
    auto o = acc.orders.find(orig.getValue());
    bool known = o != acc.orders.end();
    std::string reason;
    int rej = FIX::CxlRejReason_OTHER;
    long long expire = 0;
    double price = 0;
    if (p == acc.pending.end() || p->second.position != 0) {
      reason = known ? "too late to replace: the order is not resting" : "unknown order";
      rej = known ? FIX::CxlRejReason_TOO_LATE_TO_CANCEL : FIX::CxlRejReason_UNKNOWN_ORDER;
    } else if (acc.orders.count(cl.getValue())) {
      reason = "duplicate ClOrdID";
      rej = FIX::CxlRejReason_DUPLICATE_CLORDID_RECEIVED;
    } else {
      reason = entry_terms(m, p->second.type, p->second.side, p->second.symbol, price, expire);
    }
    if (!reason.empty()) {
      journal(who, sub_id(m), "amend", known ? o->second.symbol : "",
              known ? order_number(o->second) : 0, ' ', -1, cl.getValue(), false, reason);
      FIX44::OrderCancelReject reject =
          cancel_reject(cl, orig, known ? &o->second : nullptr,
                        FIX::CxlRejResponseTo_ORDER_CANCEL_REPLACE_REQUEST, rej, reason);
      g.unlock();
      send(reject, id);
      return;
    }
    Pending next = p->second;
    next.price = price;
    next.expire_ms = expire;
    acc.pending.erase(p);
    acc.pending[cl.getValue()] = next;
    Order replaced = o->second;
    o->second.status = FIX::OrdStatus_REPLACED;
    replaced.price = price;
    acc.orders[cl.getValue()] = replaced;
    journal(who, sub_id(m), "amend", next.symbol, order_number(replaced), next.side,
            next.units / quotes_.at(next.symbol).contract, cl.getValue(), true, "");
    FIX44::ExecutionReport er =
        report(cl.getValue(), replaced.order_id, FIX::ExecType_REPLACED, FIX::OrdStatus_NEW,
               next.symbol, next.side, next.units, 0, 0, 0);
    er.set(FIX::OrigClOrdID(orig.getValue()));
    entry_fields(er, next);
    g.unlock();
    send(er, id);
  }

  void onMessage(const FIX44::OrderMassStatusRequest& m, const FIX::SessionID& id) override {
    FIX::MassStatusReqID req;
    m.get(req);
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[login(id)];
    std::vector<FIX44::ExecutionReport> out;
    for (auto& p : acc.pending) {
      const Pending& o = p.second;
      const Order& order = acc.orders[p.first];
      FIX44::ExecutionReport er =
          report(p.first, order.order_id, FIX::ExecType_ORDER_STATUS, FIX::OrdStatus_NEW,
                 order.symbol, o.side, o.units, 0, 0, o.position);
      entry_fields(er, o);
      out.push_back(er);
    }
    if (out.empty()) {
      out.push_back(report("NONE", "NONE", FIX::ExecType_ORDER_STATUS, FIX::OrdStatus_REJECTED, "",
                           FIX::Side_BUY, 0, 0, 0, 0));
    }
    const int total = acc.pending.size();
    for (size_t i = 0; i < out.size(); ++i) {
      out[i].set(req);
      out[i].set(FIX::TotNumReports(total));
      out[i].set(FIX::LastRptRequested(i + 1 == out.size()));
    }
    g.unlock();
    for (auto& er : out) send(er, id);
  }

  // --- the hand client's entry orders, reported to the account's sessions
  std::string hand_place(const std::string& who, const std::string& symbol, char side, char type,
                         double price, double lots, long long expire) {
    std::unique_lock<std::mutex> g(mutex_);
    auto quote = quotes_.find(symbol);
    if (quote == quotes_.end()) return "error unknown symbol";
    if (!(lots > 0)) return "error lots must be positive";
    double checked = 0;
    long long until = 0;
    std::string reason =
        entry_terms(hand_terms(type, price, expire), type, side, symbol, checked, until);
    if (!reason.empty()) return "error " + reason;
    Account& acc = accounts_[who];
    std::string cl = "manual-" + next_id();
    double units = lots * quote->second.contract;
    Pending o{type, price, side, units, 0, symbol, until};
    acc.pending[cl] = o;
    acc.orders[cl] = Order{next_id(), FIX::OrdStatus_NEW, symbol, side, units, price, 0, true};
    journal(who, "manual", "place", symbol, order_number(acc.orders[cl]), side, lots, "", true, "");
    FIX44::ExecutionReport er = report(cl, acc.orders[cl].order_id, FIX::ExecType_NEW,
                                       FIX::OrdStatus_NEW, symbol, side, units, 0, 0, 0);
    entry_fields(er, o);
    std::string reply = "ok " + acc.orders[cl].order_id;
    drop_copy_reports(g, who, {er});
    return reply;
  }

  std::string hand_amend(const std::string& who, const std::string& order_id, double price) {
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[who];
    std::string cl = resting_by_order_id(acc, order_id);
    if (cl.empty()) return "error no such resting order";
    Pending next = acc.pending.at(cl);
    double checked = 0;
    long long until = 0;
    std::string reason = entry_terms(hand_terms(next.type, price, next.expire_ms), next.type,
                                     next.side, next.symbol, checked, until);
    if (!reason.empty()) return "error " + reason;
    next.price = price;
    std::string fresh = "manual-" + next_id();
    acc.pending.erase(cl);
    acc.pending[fresh] = next;
    Order replaced = acc.orders[cl];
    acc.orders[cl].status = FIX::OrdStatus_REPLACED;
    replaced.price = price;
    acc.orders[fresh] = replaced;
    journal(who, "manual", "amend", next.symbol, order_number(replaced), next.side,
            next.units / quotes_.at(next.symbol).contract, "", true, "");
    FIX44::ExecutionReport er = report(fresh, replaced.order_id, FIX::ExecType_REPLACED,
                                       FIX::OrdStatus_NEW, next.symbol, next.side, next.units, 0,
                                       0, 0);
    er.set(FIX::OrigClOrdID(cl));
    entry_fields(er, next);
    drop_copy_reports(g, who, {er});
    return "ok";
  }

  std::string hand_cancel(const std::string& who, const std::string& order_id) {
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[who];
    std::string cl = resting_by_order_id(acc, order_id);
    if (cl.empty()) return "error no such resting order";
    Pending o = acc.pending.at(cl);
    acc.pending.erase(cl);
    Order& order = acc.orders[cl];
    order.status = FIX::OrdStatus_CANCELED;
    journal(who, "manual", "cancel", o.symbol, order_number(order), o.side,
            o.units / quotes_.at(o.symbol).contract, "", true, "");
    FIX44::ExecutionReport er = report(cl, order.order_id, FIX::ExecType_CANCELED,
                                       FIX::OrdStatus_CANCELED, o.symbol, o.side, o.units, 0, 0, 0);
    drop_copy_reports(g, who, {er});
    return "ok";
  }

  // Expires the entry orders whose ExpireTime has passed (ExecType C to the account's sessions).
  void expire() {
    long long now = now_ms();
    std::vector<std::pair<FIX::SessionID, FIX44::ExecutionReport>> sends;
    {
      std::lock_guard<std::mutex> g(mutex_);
      for (auto& a : accounts_) {
        Account& acc = a.second;
        for (auto p = acc.pending.begin(); p != acc.pending.end();) {
          const Pending& o = p->second;
          if (o.position != 0 || o.expire_ms == 0 || now < o.expire_ms) {
            ++p;
            continue;
          }
          Order& order = acc.orders[p->first];
          order.status = FIX::OrdStatus_EXPIRED;
          FIX44::ExecutionReport er =
              report(p->first, order.order_id, FIX::ExecType_EXPIRED, FIX::OrdStatus_EXPIRED,
                     o.symbol, o.side, o.units, 0, 0, 0);
          for (auto& s : sessions_of(a.first)) sends.emplace_back(s, er);
          p = acc.pending.erase(p);
        }
      }
    }
    for (auto& s : sends) send(s.second, s.first);
  }

  std::string entry_orders(const std::string& who) {
    std::lock_guard<std::mutex> g(mutex_);
    Account& acc = accounts_[who];
    std::ostringstream out;
    out << "ok";
    for (auto& p : acc.pending) {
      const Pending& o = p.second;
      if (o.position != 0) continue;
      out << ' ' << acc.orders[p.first].order_id << ':' << o.symbol << ':'
          << (o.side == FIX::Side_BUY ? "buy" : "sell") << ':'
          << (o.type == FIX::OrdType_STOP ? "stop" : "limit") << ':' << std::setprecision(10)
          << o.price << ':' << o.units / quotes_.at(o.symbol).contract << ':' << o.expire_ms;
    }
    return out.str();
  }

  // Moves a symbol's quote and fills every resting order the new price reaches.
  std::string move_quote(const std::string& symbol, double bid, double ask) {
    std::unique_lock<std::mutex> g(mutex_);
    auto q = quotes_.find(symbol);
    if (q == quotes_.end()) return "error unknown symbol";
    if (!(bid > 0 && ask >= bid)) return "error bid and ask must be positive, ask >= bid";
    q->second.bid = bid;
    q->second.ask = ask;
    std::vector<std::pair<std::string, FIX44::ExecutionReport>> out;
    // Subscribed PositionReports of positions entry orders open, sent before the fills' reports
    // (a venue's order of messages is its own).
    std::vector<std::pair<std::string, FIX44::PositionReport>> opened;
    int filled = 0;
    for (auto& a : accounts_) {
      Account& acc = a.second;
      std::vector<std::string> hit;
      for (auto& p : acc.pending) {
        const Pending& o = p.second;
        if (o.position == 0) continue;  // entry orders: below
        auto pos = acc.positions.find(o.position);
        if (pos == acc.positions.end() || pos->second.symbol != symbol) continue;
        bool sell = o.side == FIX::Side_SELL;
        double px = sell ? bid : ask;
        bool stop = o.type == FIX::OrdType_STOP;
        bool reached = sell ? (stop ? px <= o.price : px >= o.price)
                            : (stop ? px >= o.price : px <= o.price);
        if (reached) hit.push_back(p.first);
      }
      for (auto& cl : hit) {
        auto p = acc.pending.find(cl);
        if (p == acc.pending.end()) continue;  // cancelled as an orphan of an earlier hit
        Pending o = p->second;
        acc.pending.erase(p);
        auto pos = acc.positions.find(o.position);
        if (pos == acc.positions.end()) continue;
        Position before = pos->second;
        double units = std::min(o.units, before.units);
        fill(acc, symbol, o.side, units, o.price, o.position);
        Order& order = acc.orders[cl];
        order.status = FIX::OrdStatus_FILLED;
        order.price = o.price;
        journal(a.first, o.type == FIX::OrdType_STOP ? "stop" : "limit", "close", symbol,
                o.position, before.side, units / q->second.contract, cl, true, "");
        out.emplace_back(a.first, report(cl, order.order_id, FIX::ExecType_TRADE,
                                         FIX::OrdStatus_FILLED, symbol, o.side, units, units,
                                         o.price, o.position));
        for (auto& orphan : cancel_orphans(acc, o.position)) out.emplace_back(a.first, orphan);
        ++filled;
      }
      // Entry orders the price reached: filled at their price, each opening a position.
      std::vector<std::string> entries;
      for (auto& p : acc.pending) {
        const Pending& o = p.second;
        if (o.position != 0 || o.symbol != symbol) continue;
        bool buy = o.side == FIX::Side_BUY;
        double px = buy ? ask : bid;
        bool stop = o.type == FIX::OrdType_STOP;
        bool reached = buy ? (stop ? px >= o.price : px <= o.price)
                           : (stop ? px <= o.price : px >= o.price);
        if (reached) entries.push_back(p.first);
      }
      for (auto& cl : entries) {
        Pending o = acc.pending.at(cl);
        acc.pending.erase(cl);
        long ticket = fill(acc, symbol, o.side, o.units, o.price, 0);
        Order& order = acc.orders[cl];
        order.status = FIX::OrdStatus_FILLED;
        order.price = o.price;
        order.position = ticket;
        for (auto& r : subscribed_reports(acc, ticket, Position{}))
          opened.emplace_back(a.first, r);
        // The hand client's orders' fills reach other sessions only as PositionReports with
        // no_drop_copy.
        bool manual = cl.rfind("manual-", 0) == 0;
        if (!(manual && no_drop_copy))
          out.emplace_back(a.first, report(cl, order.order_id, FIX::ExecType_TRADE,
                                           FIX::OrdStatus_FILLED, symbol, o.side, o.units,
                                           o.units, o.price, ticket));
        ++filled;
      }
    }
    std::vector<std::pair<FIX::SessionID, FIX44::ExecutionReport>> sends;
    std::vector<std::pair<FIX::SessionID, FIX44::PositionReport>> reports;
    for (auto& o : opened)
      for (auto& s : sessions_of(o.first)) reports.emplace_back(s, o.second);
    for (auto& o : out)
      for (auto& s : sessions_of(o.first)) sends.emplace_back(s, o.second);
    g.unlock();
    for (auto& r : reports) send(r.second, r.first);
    for (auto& s : sends) send(s.second, s.first);
    return "ok " + std::to_string(filled);
  }

  // --- the hand client (control port)
  std::string hand_open(const std::string& who, const std::string& symbol, char side, double lots) {
    std::unique_lock<std::mutex> g(mutex_);
    auto quote = quotes_.find(symbol);
    if (quote == quotes_.end()) return "error unknown symbol";
    if (!(lots > 0)) return "error lots must be positive";
    Account& acc = accounts_[who];
    double units = lots * quote->second.contract;
    double price = side == FIX::Side_BUY ? quote->second.ask : quote->second.bid;
    long ticket = fill(acc, symbol, side, units, price, 0);
    journal(who, "manual", "open", symbol, ticket, side, lots, "", true, "");
    return drop_copy(g, who, acc, symbol, side, units, price, ticket, Position{});
  }

  std::string hand_close(const std::string& who, long ticket, double lots) {
    std::unique_lock<std::mutex> g(mutex_);
    Account& acc = accounts_[who];
    auto p = acc.positions.find(ticket);
    if (p == acc.positions.end()) return "error no such position";
    if (!(lots > 0)) return "error lots must be positive";
    Position before = p->second;
    auto quote = quotes_.at(p->second.symbol);
    double units = std::min(lots * quote.contract, p->second.units);
    char side = p->second.side == FIX::Side_BUY ? FIX::Side_SELL : FIX::Side_BUY;
    std::string symbol = p->second.symbol;
    double price = side == FIX::Side_BUY ? quote.ask : quote.bid;
    fill(acc, symbol, side, units, price, ticket);
    journal(who, "manual", "close", symbol, ticket, before.side, units / quote.contract, "", true,
            "");
    std::vector<FIX44::ExecutionReport> orphans = cancel_orphans(acc, ticket);
    std::vector<FIX::SessionID> sessions = sessions_of(who);
    std::string reply = drop_copy(g, who, acc, symbol, side, units, price, ticket, before);
    for (auto& s : sessions)
      for (auto& o : orphans) send(o, s);
    return reply;
  }

  // The venue forgets the account's ClOrdIDs (as after a trading-day roll): status requests for
  // them answer "unknown order", and a duplicate is no longer refused.
  std::string forget(const std::string& who) {
    std::lock_guard<std::mutex> g(mutex_);
    Account& acc = accounts_[who];
    for (auto o = acc.orders.begin(); o != acc.orders.end();) {
      if (acc.pending.count(o->first)) ++o;
      else o = acc.orders.erase(o);
    }
    return "ok";
  }

  // Resets the sequence numbers of `who`'s sessions: `quiet`, with no Logout (the connection
  // dropped and both sides at 1, as a venue restarted without its store), else as QuickFIX
  // resets a session (a Logout, then both sides at 1).
  std::string reset(const std::string& who, bool quiet) {
    std::vector<FIX::SessionID> sessions;
    {
      std::lock_guard<std::mutex> g(mutex_);
      for (auto& s : logged_on_)
        if (login(s) == who) sessions.push_back(s);
    }
    if (sessions.empty()) return "error not logged on";
    for (auto& id : sessions) {
      FIX::Session* s = FIX::Session::lookupSession(id);
      if (!s) continue;
      if (!quiet) {
        s->reset();
        continue;
      }
      s->disconnect();
      s->setNextSenderMsgSeqNum(1);
      s->setNextTargetMsgSeqNum(1);
    }
    return "ok";
  }

  std::string positions(const std::string& who) {
    std::lock_guard<std::mutex> g(mutex_);
    std::ostringstream out;
    out << "ok";
    for (auto& p : accounts_[who].positions) {
      out << ' ' << p.first << ':' << p.second.symbol << ':'
          << (p.second.side == FIX::Side_BUY ? "buy" : "sell") << ':'
          << p.second.units / quotes_.at(p.second.symbol).contract;
    }
    return out.str();
  }

 private:
  static std::string login(const FIX::SessionID& id) { return id.getTargetCompID().getValue(); }

  static std::string sub_id(const FIX::Message& m) {
    return m.getHeader().isSetField(50) ? m.getHeader().getField(50) : "";
  }

  std::string next_id() { return std::to_string(++ids_); }

  std::vector<FIX::SessionID> sessions_of(const std::string& who) {
    std::vector<FIX::SessionID> out;
    for (auto& s : logged_on_)
      if (login(s) == who) out.push_back(s);
    return out;
  }

  // A resting protective order: accepted (ExecType New) or rejected.
  void protect(std::unique_lock<std::mutex>& g, Account& acc, const std::string& who,
               const std::string& client, const FIX::SessionID& id, const FIX::Message& m,
               const std::string& cl, char type, char side, const std::string& symbol,
               double units, long position) {
    double price = 0;
    std::string reason;
    int rej = FIX::OrdRejReason_OTHER;
    const int price_tag = type == FIX::OrdType_STOP ? 99 : 44;
    auto p = acc.positions.find(position);
    if (acc.orders.count(cl)) {
      reason = "duplicate ClOrdID";
      rej = FIX::OrdRejReason_DUPLICATE_ORDER;
    } else if (!m.isSetField(price_tag)) {
      reason = type == FIX::OrdType_STOP ? "a stop order needs StopPx" : "a limit order needs Price";
    } else if (p == acc.positions.end()) {
      reason = "no such position";
    } else if (p->second.symbol != symbol) {
      reason = "the position is on another symbol";
    } else if (p->second.side == side) {
      reason = "a protective order must take the opposite side";
    } else if (!(units > 0)) {
      reason = "invalid quantity";
      rej = FIX::OrdRejReason_INCORRECT_QUANTITY;
    } else {
      price = std::stod(m.getField(price_tag));
      const Quote& q = quotes_.at(symbol);
      double now = side == FIX::Side_SELL ? q.bid : q.ask;
      bool stop = type == FIX::OrdType_STOP;
      bool wrong_side = side == FIX::Side_SELL ? (stop ? price >= now : price <= now)
                                               : (stop ? price <= now : price >= now);
      if (!(price > 0) || wrong_side) reason = "invalid stops: the price is on the wrong side of the market";
    }
    char journal_side = p != acc.positions.end() ? p->second.side : side;
    if (!reason.empty()) {
      if (rej != FIX::OrdRejReason_DUPLICATE_ORDER)
        acc.orders[cl] = Order{next_id(), FIX::OrdStatus_REJECTED, symbol, side, units, 0, position};
      journal(who, client, "modify", symbol, position, journal_side, -1, cl, false, reason);
      FIX44::ExecutionReport er = report(cl, next_id(), FIX::ExecType_REJECTED,
                                         FIX::OrdStatus_REJECTED, symbol, side, units, 0, 0,
                                         position);
      er.set(FIX::OrdRejReason(rej));
      er.set(FIX::Text(reason));
      g.unlock();
      send(er, id);
      return;
    }
    acc.pending[cl] = Pending{type, price, side, units, position, symbol, 0};
    acc.orders[cl] = Order{next_id(), FIX::OrdStatus_NEW, symbol, side, units, price, position};
    journal(who, client, "modify", symbol, position, journal_side, -1, cl, true, "");
    FIX44::ExecutionReport er = report(cl, acc.orders[cl].order_id, FIX::ExecType_NEW,
                                       FIX::OrdStatus_NEW, symbol, side, units, 0, 0, position);
    if (type == FIX::OrdType_STOP) er.set(FIX::StopPx(price));
    else er.set(FIX::Price(price));
    er.set(FIX::OrdType(type));
    g.unlock();
    send(er, id);
  }

  static long order_number(const Order& o) { return std::atol(o.order_id.c_str()); }

  // The refusal of a cancel (F) or cancel/replace (G) of `orig` (`known`: the venue's order, or
  // null when it has none by that ClOrdID).
  static FIX44::OrderCancelReject cancel_reject(const FIX::ClOrdID& cl,
                                                const FIX::OrigClOrdID& orig, const Order* known,
                                                char response_to, int reason,
                                                const std::string& text) {
    FIX44::OrderCancelReject reject(
        FIX::OrderID(known ? known->order_id : "NONE"), cl, orig,
        FIX::OrdStatus(known ? known->status : FIX::OrdStatus_REJECTED),
        FIX::CxlRejResponseTo(response_to));
    reject.set(FIX::CxlRejReason(reason));
    reject.set(FIX::Text(text));
    return reject;
  }

  // The ClOrdID under which entry order `order_id` rests now ("" when none does).
  static std::string resting_by_order_id(Account& acc, const std::string& order_id) {
    for (auto& p : acc.pending)
      if (p.second.position == 0 && acc.orders[p.first].order_id == order_id) return p.first;
    return "";
  }

  // Sends reports of the hand client's orders to the account's sessions (unless no_drop_copy);
  // releases the lock first.
  void drop_copy_reports(std::unique_lock<std::mutex>& g, const std::string& who,
                         std::vector<FIX44::ExecutionReport> reports) {
    std::vector<FIX::SessionID> sessions = sessions_of(who);
    g.unlock();
    if (no_drop_copy) return;
    for (auto& s : sessions)
      for (auto& r : reports) send(r, s);
  }

  // The hand client's entry order terms as a message carries them (price, expiry).
  static FIX44::NewOrderSingle hand_terms(char type, double price, long long expire) {
    FIX44::NewOrderSingle terms;
    terms.setField(type == FIX::OrdType_STOP ? 99 : 44, std::to_string(price));
    if (expire > 0) {
      terms.setField(59, "6");
      terms.setField(126, utc_text(expire));
    }
    return terms;
  }

  // An entry order's price and expiry from a NewOrderSingle or OrderCancelReplaceRequest; the
  // reason it is refused, or "".
  std::string entry_terms(const FIX::Message& m, char type, char side, const std::string& symbol,
                          double& price, long long& expire) {
    const int price_tag = type == FIX::OrdType_STOP ? 99 : 44;
    if (!m.isSetField(price_tag))
      return type == FIX::OrdType_STOP ? "a stop order needs StopPx" : "a limit order needs Price";
    price = std::stod(m.getField(price_tag));
    const Quote& q = quotes_.at(symbol);
    double now = side == FIX::Side_BUY ? q.ask : q.bid;
    bool stop = type == FIX::OrdType_STOP;
    bool wrong = side == FIX::Side_BUY ? (stop ? price <= now : price >= now)
                                       : (stop ? price >= now : price <= now);
    if (!(price > 0) || wrong) return "invalid price: on the wrong side of the market";
    expire = 0;
    std::string tif = m.isSetField(59) ? m.getField(59) : "1";
    if (tif == "6") {
      if (!m.isSetField(126)) return "good till date needs ExpireTime";
      expire = parse_utc(m.getField(126));
      if (expire < 0) return "ExpireTime is not a UTC timestamp";
      if (expire <= now_ms()) return "invalid expiration: the expiry is in the past";
    } else if (tif != "1" && tif != "0") {
      return "entry orders are good till cancelled or good till date";
    }
    return "";
  }

  static void entry_fields(FIX44::ExecutionReport& er, const Pending& o) {
    er.set(FIX::OrdType(o.type));
    if (o.type == FIX::OrdType_STOP) er.set(FIX::StopPx(o.price));
    else er.set(FIX::Price(o.price));
    if (o.expire_ms != 0) {
      er.set(FIX::TimeInForce(FIX::TimeInForce_GOOD_TILL_DATE));
      er.setField(126, utc_text(o.expire_ms));
    } else {
      er.set(FIX::TimeInForce(FIX::TimeInForce_GOOD_TILL_CANCEL));
    }
  }

  static std::string utc_text(long long ms) {
    std::time_t secs = static_cast<std::time_t>(ms / 1000);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%04d%02d%02d-%02d:%02d:%02d.%03d", tm.tm_year + 1900,
                  tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                  static_cast<int>(ms % 1000));
    return buf;
  }

  // An entry order: accepted (ExecType New) to rest, or rejected.
  void enter(std::unique_lock<std::mutex>& g, Account& acc, const std::string& who,
             const std::string& client, const FIX::SessionID& id, const FIX::Message& m,
             const std::string& cl, char type, char side, const std::string& symbol,
             double units) {
    std::string reason;
    int rej = FIX::OrdRejReason_OTHER;
    double price = 0;
    long long expire = 0;
    auto quote = quotes_.find(symbol);
    if (acc.orders.count(cl)) {
      reason = "duplicate ClOrdID";
      rej = FIX::OrdRejReason_DUPLICATE_ORDER;
    } else if (quote == quotes_.end()) {
      reason = "unknown symbol";
      rej = FIX::OrdRejReason_UNKNOWN_SYMBOL;
    } else if (!(units > 0)) {
      reason = "invalid quantity";
      rej = FIX::OrdRejReason_INCORRECT_QUANTITY;
    } else {
      reason = entry_terms(m, type, side, symbol, price, expire);
    }
    double lots = quote == quotes_.end() ? -1 : units / quote->second.contract;
    if (!reason.empty()) {
      std::string order_id = next_id();
      if (rej != FIX::OrdRejReason_DUPLICATE_ORDER)
        acc.orders[cl] = Order{order_id, FIX::OrdStatus_REJECTED, symbol, side, units, 0, 0, true};
      journal(who, client, "place", symbol, 0, side, lots, cl, false, reason);
      FIX44::ExecutionReport er = report(cl, order_id, FIX::ExecType_REJECTED,
                                         FIX::OrdStatus_REJECTED, symbol, side, units, 0, 0, 0);
      er.set(FIX::OrdRejReason(rej));
      er.set(FIX::Text(reason));
      g.unlock();
      send(er, id);
      return;
    }
    Pending o{type, price, side, units, 0, symbol, expire};
    acc.pending[cl] = o;
    acc.orders[cl] = Order{next_id(), FIX::OrdStatus_NEW, symbol, side, units, price, 0, true};
    journal(who, client, "place", symbol, order_number(acc.orders[cl]), side, lots, cl, true, "");
    FIX44::ExecutionReport er = report(cl, acc.orders[cl].order_id, FIX::ExecType_NEW,
                                       FIX::OrdStatus_NEW, symbol, side, units, 0, 0, 0);
    entry_fields(er, o);
    g.unlock();
    if (lose_reply) return;
    send(er, id);
  }

  // Cancels the resting orders of a position that is gone: their ExecutionReports (Canceled).
  std::vector<FIX44::ExecutionReport> cancel_orphans(Account& acc, long position) {
    std::vector<FIX44::ExecutionReport> out;
    if (acc.positions.count(position)) return out;
    for (auto p = acc.pending.begin(); p != acc.pending.end();) {
      if (p->second.position != position) {
        ++p;
        continue;
      }
      Order& order = acc.orders[p->first];
      order.status = FIX::OrdStatus_CANCELED;
      out.push_back(report(p->first, order.order_id, FIX::ExecType_CANCELED,
                           FIX::OrdStatus_CANCELED, order.symbol, p->second.side, p->second.units,
                           0, 0, position));
      p = acc.pending.erase(p);
    }
    return out;
  }

  // Applies a fill to the account's positions; returns the position's ticket.
  long fill(Account& acc, const std::string& symbol, char side, double units, double price,
            long position) {
    if (position == 0) {
      long ticket = ++tickets_;
      acc.positions[ticket] = Position{symbol, side, units, price};
      return ticket;
    }
    Position& p = acc.positions.at(position);
    p.units -= units;
    if (p.units <= 1e-9) acc.positions.erase(position);
    return position;
  }

  // Pushes an unsolicited ExecutionReport (and subscribed PositionReports) for a trade the hand
  // client placed, to the account's session if it is logged on.
  std::string drop_copy(std::unique_lock<std::mutex>& g, const std::string& who, Account& acc,
                        const std::string& symbol, char side, double units, double price,
                        long ticket, const Position& before) {
    FIX44::ExecutionReport er = report("manual-" + next_id(), next_id(), FIX::ExecType_TRADE,
                                       FIX::OrdStatus_FILLED, symbol, side, units, units, price,
                                       ticket);
    std::vector<FIX44::PositionReport> updates = subscribed_reports(acc, ticket, before);
    std::vector<FIX::SessionID> sessions;
    for (auto& s : logged_on_)
      if (login(s) == who) sessions.push_back(s);
    g.unlock();
    for (auto& s : sessions) {
      if (!no_drop_copy) send(er, s);
      for (auto& u : updates) send(u, s);
    }
    return "ok " + std::to_string(ticket);
  }

  // The position's report for every subscription: as it is now, or (closed) as it was before
  // the fill with no quantity left.
  std::vector<FIX44::PositionReport> subscribed_reports(Account& acc, long ticket,
                                                        const Position& before) {
    std::vector<FIX44::PositionReport> out;
    auto p = acc.positions.find(ticket);
    Position closed = before;
    closed.units = 0;
    for (auto& req : acc.subscriptions)
      out.push_back(position_report(req, ticket, p == acc.positions.end() ? closed : p->second));
    return out;
  }

  FIX44::PositionReport position_report(const std::string& req, long ticket, const Position& p) {
    FIX44::PositionReport r;
    r.set(FIX::PosMaintRptID(std::to_string(ticket)));
    r.set(FIX::PosReqID(req));
    r.set(FIX::PosReqResult(FIX::PosReqResult_VALID_REQUEST));
    r.set(FIX::ClearingBusinessDate("20261130"));
    r.set(FIX::SettlPrice(p.price));
    r.set(FIX::SettlPriceType(FIX::SettlPriceType_FINAL));
    r.set(FIX::PriorSettlPrice(p.price));
    r.setField(FIX::Symbol(p.symbol));
    FIX44::PositionReport::NoPositions pos;
    pos.set(FIX::PosType(FIX::PosType_TRANSACTION_QUANTITY));
    pos.set(FIX::LongQty(p.side == FIX::Side_BUY ? p.units : 0));
    pos.set(FIX::ShortQty(p.side == FIX::Side_SELL ? p.units : 0));
    r.addGroup(pos);
    return r;
  }

  FIX44::ExecutionReport report(const std::string& cl, const std::string& order_id, char exec_type,
                                char status, const std::string& symbol, char side, double qty,
                                double filled, double price, long position) {
    FIX44::ExecutionReport er(FIX::OrderID(order_id), FIX::ExecID(next_id()),
                              FIX::ExecType(exec_type), FIX::OrdStatus(status), FIX::Side(side),
                              FIX::LeavesQty(0), FIX::CumQty(filled), FIX::AvgPx(price));
    er.set(FIX::ClOrdID(cl));
    er.set(FIX::Symbol(symbol));
    er.set(FIX::OrderQty(qty));
    if (filled > 0) {
      er.set(FIX::LastQty(filled));
      er.set(FIX::LastPx(price));
    }
    er.set(FIX::TransactTime());
    if (position != 0) er.setField(721, std::to_string(position));
    return er;
  }

  void send(FIX::Message& m, const FIX::SessionID& id) {
    try {
      FIX::Session::sendToTarget(m, id);
    } catch (FIX::SessionNotFound&) {
    }
  }

  void journal(const std::string& who, const std::string& client, const std::string& action,
               const std::string& symbol, long ticket, char side, double lots,
               const std::string& client_order_id, bool accepted, const std::string& reason) {
    std::ostringstream line;
    const long long us = now_us();
    line << "{\"ts_ms\":" << us / 1000 << ",\"ts_us\":" << us << ",\"login\":" << json_str(who)
         << ",\"client\":" << json_str(client.empty() ? "unknown" : client)
         << ",\"action\":" << json_str(action)
         << ",\"ticket\":" << (ticket ? std::to_string(ticket) : "null")
         << ",\"symbol\":" << opt_str(symbol) << ",\"side\":"
         << (side == FIX::Side_BUY ? "\"buy\"" : side == FIX::Side_SELL ? "\"sell\"" : "null")
         << ",\"volume\":";
    if (action == "login" || lots < 0) line << "null";
    else line << std::setprecision(12) << lots;
    line << ",\"magic\":null,\"comment\":null,\"fence\":null,\"client_order_id\":"
         << opt_str(client_order_id) << ",\"accepted\":" << (accepted ? "true" : "false")
         << ",\"reason\":" << opt_str(reason) << "}\n";
    journal_ << line.str();
    journal_.flush();
  }

  const FIX::SessionSettings& settings_;
  std::map<std::string, Quote> quotes_ = QUOTES;
  std::ofstream journal_;
  std::mutex mutex_;
  std::map<std::string, Account> accounts_;
  std::set<FIX::SessionID> logged_on_;
  long long ids_ = 0;
  long tickets_ = 5000000;
};

std::string handle(Venue& venue, const std::string& line, bool& quit) {
  std::istringstream in(line);
  std::string cmd;
  in >> cmd;
  try {
    if (cmd == "open") {
      std::string who, symbol, side;
      double lots;
      if (!(in >> who >> symbol >> side >> lots)) return "error usage: open <login> <symbol> <buy|sell> <lots>";
      if (side != "buy" && side != "sell") return "error side must be buy or sell";
      return venue.hand_open(who, symbol, side == "buy" ? FIX::Side_BUY : FIX::Side_SELL, lots);
    }
    if (cmd == "close") {
      std::string who;
      long ticket;
      double lots;
      if (!(in >> who >> ticket >> lots)) return "error usage: close <login> <ticket> <lots>";
      return venue.hand_close(who, ticket, lots);
    }
    if (cmd == "place") {
      std::string who, symbol, side, type;
      double price, lots;
      long long expire = 0;
      if (!(in >> who >> symbol >> side >> type >> price >> lots))
        return "error usage: place <login> <symbol> <buy|sell> <limit|stop> <price> <lots> [<expiry ms>]";
      in >> expire;
      if (side != "buy" && side != "sell") return "error side must be buy or sell";
      if (type != "limit" && type != "stop") return "error type must be limit or stop";
      return venue.hand_place(who, symbol, side == "buy" ? FIX::Side_BUY : FIX::Side_SELL,
                              type == "stop" ? FIX::OrdType_STOP : FIX::OrdType_LIMIT, price, lots,
                              expire);
    }
    if (cmd == "amend") {
      std::string who, order_id;
      double price;
      if (!(in >> who >> order_id >> price)) return "error usage: amend <login> <OrderID> <price>";
      return venue.hand_amend(who, order_id, price);
    }
    if (cmd == "cancel") {
      std::string who, order_id;
      if (!(in >> who >> order_id)) return "error usage: cancel <login> <OrderID>";
      return venue.hand_cancel(who, order_id);
    }
    if (cmd == "positions") {
      std::string who;
      in >> who;
      return venue.positions(who);
    }
    if (cmd == "orders") {
      std::string who;
      in >> who;
      return venue.entry_orders(who);
    }
    if (cmd == "fault") {
      std::string name, state;
      in >> name >> state;
      bool on = state == "on";
      if (name == "drop_after_fill") venue.drop_after_fill = on;
      else if (name == "lose_reply") venue.lose_reply = on;
      else if (name == "refuse_logon") venue.refuse_logon = on;
      else if (name == "gap_after_fill") venue.gap_after_fill = on;
      else if (name == "no_drop_copy") venue.no_drop_copy = on;
      else if (name == "no_ao") venue.no_ao = on;
      else return "error unknown fault " + name;
      return "ok";
    }
    if (cmd == "quote") {
      std::string symbol;
      double bid, ask;
      if (!(in >> symbol >> bid >> ask)) return "error usage: quote <symbol> <bid> <ask>";
      return venue.move_quote(symbol, bid, ask);
    }
    if (cmd == "reset" || cmd == "renumber") {
      std::string who;
      in >> who;
      return venue.reset(who, cmd == "renumber");
    }
    if (cmd == "forget") {
      std::string who;
      in >> who;
      return venue.forget(who);
    }
    if (cmd == "quit") {
      quit = true;
      return "ok";
    }
  } catch (std::exception& e) {
    return std::string("error ") + e.what();
  }
  return "error unknown command " + cmd;
}

// The control port: one connection at a time, one command per line, served between the
// acceptor's polls on the one thread that also runs every QuickFIX callback (so a command such
// as `reset` never races the session layer).
class Control {
 public:
  explicit Control(int port) {
    server_ = socket(AF_INET, SOCK_STREAM, 0);
    int yes = 1;
    setsockopt(server_, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(server_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        listen(server_, 8) != 0) {
      std::perror("control port");
      std::exit(2);
    }
    fcntl(server_, F_SETFL, O_NONBLOCK);
  }

  // Accepts and answers whatever is waiting; true once `quit` was asked.
  bool service(Venue& venue) {
    if (client_ < 0) {
      client_ = accept(server_, nullptr, nullptr);
      if (client_ < 0) return false;
      fcntl(client_, F_SETFL, O_NONBLOCK);
      buf_.clear();
    }
    char chunk[1024];
    ssize_t n = read(client_, chunk, sizeof chunk);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      close(client_);
      client_ = -1;
      return false;
    }
    if (n > 0) buf_.append(chunk, static_cast<size_t>(n));
    bool quit = false;
    size_t nl;
    while ((nl = buf_.find('\n')) != std::string::npos) {
      std::string reply = handle(venue, buf_.substr(0, nl), quit) + "\n";
      buf_.erase(0, nl + 1);
      if (write(client_, reply.data(), reply.size()) < 0) break;
    }
    return quit;
  }

 private:
  int server_ = -1;
  int client_ = -1;
  std::string buf_;
};

// The venue's logs are QuickFIX's files; the acceptor's own events also reach the venue, which
// journals the Logons QuickFIX refused.
class VenueLog : public FIX::Log {
 public:
  VenueLog(FIX::Log* inner, Venue& venue) : inner_(inner), venue_(venue) {}
  void clear() override { inner_->clear(); }
  void backup() override { inner_->backup(); }
  void onIncoming(const std::string& s) override { inner_->onIncoming(s); }
  void onOutgoing(const std::string& s) override { inner_->onOutgoing(s); }
  void onEvent(const std::string& s) override {
    inner_->onEvent(s);
    const std::string prefix = "Session not found for incoming message: ";
    if (s.compare(0, prefix.size(), prefix) == 0) venue_.refused_logon(s.substr(prefix.size()));
  }
  FIX::Log* inner() { return inner_; }

 private:
  FIX::Log* inner_;
  Venue& venue_;
};

class VenueLogFactory : public FIX::LogFactory {
 public:
  VenueLogFactory(const FIX::SessionSettings& settings, Venue& venue)
      : files_(settings), venue_(venue) {}
  FIX::Log* create() override { return new VenueLog(files_.create(), venue_); }
  FIX::Log* create(const FIX::SessionID& id) override { return files_.create(id); }
  void destroy(FIX::Log* log) override {
    if (auto* v = dynamic_cast<VenueLog*>(log)) {
      files_.destroy(v->inner());
      delete v;
    } else {
      files_.destroy(log);
    }
  }

 private:
  FIX::FileLogFactory files_;
  Venue& venue_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0] << " <settings> <journal.jsonl> <control-port>" << std::endl;
    return 2;
  }
  try {
    FIX::SessionSettings settings(argv[1]);
    Venue venue(settings, argv[2]);
    FIX::MemoryStoreFactory store;
    VenueLogFactory logs(settings, venue);
    FIX::SocketAcceptor acceptor(venue, store, settings, logs);
    Control control(std::stoi(argv[3]));
    acceptor.poll(0);  // binds the FIX port before anyone is told the venue is ready
    std::cout << "fix-acceptor: ready" << std::endl;
    // Ends with the test that started it, even one that crashed before it could stop the venue.
    const pid_t parent = getppid();
    while (!control.service(venue) && getppid() == parent) {
      acceptor.poll(0.005);
      venue.expire();
    }
    acceptor.stop();
    return 0;
  } catch (std::exception& e) {
    std::cerr << "fix-acceptor: " << e.what() << std::endl;
    return 1;
  }
}
